"""The service's settings (``settings.py``), the store's search and TTL settings (``store.py``), and the
settings' rendered reference (``docs.py``)."""
