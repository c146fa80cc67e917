"""Generated tasks: a fictional knowledge base plus tool-use questions (see ``synthetic``)."""
