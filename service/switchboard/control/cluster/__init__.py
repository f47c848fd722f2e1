"""The cluster: what makes several processes on one database one service (docs/cluster.md). Each node holds a lease
on the database and the sessions it runs are claimed under it (``ownership``; in single-node mode the same lease
keeps a second instance off the database); where a session runs is read from the database (``routing``); durable
events reach every node's streams through Redis (``fanout``) and are put back in order there, gaps filled from the
database (``feed``, ``session_order``); the write rate limits are one set of buckets in Redis (``shared_buckets``);
and a node that stops hands its sessions over first (``drain``). Redis carries hints and counters, never a decision:
the database says who owns what."""
