"""The worker process (internal): what runs inside each worker that an executor starts.

- ``main``: the process entry (``worker_main``): ready handshake, death watch, signals, the
  RPC loop that reads calls and dispatches them to the user's worker object;
- ``output``: how replies go back (inline, or from the async output thread);
- ``stall_watch``: the watchdog that explains calls that run too long (stack dumps, stall
  reports); user code reaches it through ``mpx.watchdog``;
- ``tracing``: the worker's half of ``Config.tracing`` (a span around each traced call).

Runs only in worker processes. Of the processes layer (mpx/__init__.py): it may import the
queue (``mpx.queue``) and the layers below it (``mpx.transport``, ``mpx.protocol``,
``mpx.mechanism``, the base modules such as ``mpx.errors``, ``mpx.config``, ``mpx.dumps``,
``mpx.watchdog``), never ``mpx._driver``, ``mpx._node`` or ``mpx._cli``.
"""
