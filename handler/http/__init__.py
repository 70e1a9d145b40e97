"""The HTTP front: the Flask app and gunicorn worker, admission guards, metrics, and one module
per API protocol (handler.http.protocols) translating to and from the engine's request model."""
