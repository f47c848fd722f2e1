"""Sessions over HTTP: create, list, read and close them, the operator's commands, chat and speeches (``routes``), and
a whole session as one JSON document (``export``)."""
