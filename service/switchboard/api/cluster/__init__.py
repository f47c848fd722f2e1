"""Cluster mode at the edge: every request about a session reaches the node that runs it through the routing seam
(``routing``), which forwards commands (``forward``) and relays media edges (``relay``) to that node; and the views
of the whole cluster, its attention list (``attention``) and its nodes (``routes``)."""
