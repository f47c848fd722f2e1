"""Tool calls over HTTP: list, read and cancel them (``routes``), and the progress and results that webhook-tool
backends report for the calls they answered 202 (``reports``)."""
