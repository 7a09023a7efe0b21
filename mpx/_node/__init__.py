"""Multi-node groups and the starting of a node's workers (internal).

- ``local_workers``: starts, hands shakes with and stops one node's worker processes; runs
  in the process that owns them (the driver, or a follower node);
- ``leader``: the driver's side of a multi-node group (runs in the driver);
- ``follower``: a follower node, ``python -m mpx node`` (its own process on each other node);
- ``relay``: a follower's one network read per call, rebroadcast to its workers over shm;
- ``control``: the HMAC-sealed control channel between leader and followers;
- ``ray_launcher``: ``launcher="ray"``: starts a follower node as a Ray actor on each
  other node (runs in the driver).

Of the processes layer (mpx/__init__.py): it may import the queue and the layers below it
(the protocol, ``mpx.protocol.wire`` included, and the base modules such as
``mpx.config``, ``mpx.errors``, ``mpx.dumps``) and ``mpx._worker.main`` (a process entry
point), never ``mpx._driver`` or ``mpx._cli``.
"""
