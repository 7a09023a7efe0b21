"""The driver (internal): the process that owns an executor and calls its workers.

- :mod:`.executor`: ``Executor``, the public facade; it holds no state of its own.
- :mod:`.group`: the processes, queues and threads one executor owns, how they start, how a
  failure stops them and how they shut down.
- :mod:`.membership`: the one owner of the group's membership (ranks, processes,
  incarnations, restarts, deaths, the distributed port, the queues), changed in one step.
- :mod:`.calls`: the call table and the reply pump: sequence numbers, pending calls, sending,
  reading replies (in the waiting thread, or a background reader), deadlines.
- :mod:`.monitors`: the threads that notice a dead worker process or a lost node.
- :mod:`.regroup`: re-forming a running group: a dead rank restarted in place (by the
  ``mpx-restarter`` thread), a resize; :mod:`.interrupts` holds Ctrl-C back meanwhile.
- :mod:`.lockorder`: every driver lock with its rank, the order they nest in, and the check
  of it (``MPX_CHECK_LOCKS=1``).
- :mod:`.stalls`: why a rank has not answered (watchdog reports, dumps, process state).
- :mod:`.futures`: ``RPCFuture``, awaitable, over the futures core.
- The futures core, the hot parts of a call and its future, each module one source
  (Cython's pure-Python mode, its C types in the ``.pxd`` beside it), compiled where it
  was built, else run as plain Python; they import each other and :mod:`mpx._interp`, no
  other mpx module, and are told the rest (:mod:`.core_settings`, ``CoreSettings``):
  :mod:`.locks` (the C lock, the baton), :mod:`.meter` (what the calls measure as they
  go), :mod:`.ledger` (a call's record of its replies, the calls in flight),
  :mod:`.waiters` (what an awaiting asyncio task waits on), :mod:`.future_core` (the
  future's state, completion and hand-off); :mod:`.primitives` holds the few primitives
  whose C and Python forms differ (``primitives.pxd``, ``primitives.py``).
- :mod:`.stats`: ``Executor.stats()``'s snapshot of the meter and the workers;
  :mod:`.stats_server`, the ``Config.stats_socket`` endpoint that ``python -m mpx top`` reads.
- :mod:`.preflight`: the checks made before any worker starts.

The driver talks to worker processes only through the messages of :mod:`mpx.protocol.wire`. It may
import the queue and the layers below it, the shared modules (``mpx.protocol.wire``, ``mpx.config``,
``mpx.errors``, ``mpx.dumps``) and ``mpx._node`` (to start workers and lead other nodes),
never ``mpx._worker`` or ``mpx._cli``.
"""
