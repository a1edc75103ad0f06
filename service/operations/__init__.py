"""The operations behind the HTTP API, free of HTTP: the saver's (``saver.py``) and the store's (``store.py``)."""
