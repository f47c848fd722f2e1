"""The control layer: hosts live sessions on the store (``SessionHost``), fans durable events out to subscribers
(``EventHub``), and holds the service's settings, logging and metrics. Imports the runtime, the store and the
integrations; never the web layer."""
