"""The worker process (internal): what runs inside each worker that an executor starts.

- ``main``: the process entry (``worker_main``): ready handshake, death watch, signals, the
  RPC loop that reads calls and dispatches them to the user's worker object;
- ``output``: how replies go back (inline, or from the async output thread);
- ``watchdog``: explains calls that run too long (stack dumps, stall reports).

Runs only in worker processes. It may import the layers below the queue (``mpx.queue``,
``mpx.transport``, ``mpx.protocol.serde``), the shared modules (``mpx.protocol.wire``, ``mpx.config``,
``mpx.errors``, ``mpx.dumps``), never ``mpx._driver``, ``mpx._node`` or ``mpx._cli``.
"""
