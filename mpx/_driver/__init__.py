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
- :mod:`.futures`: ``RPCFuture``, awaitable, over :mod:`.future_core` (a call's record and
  the future's hot part: one source, compiled where it was built, else run as plain Python;
  it imports no other mpx module; its ``Meter`` measures the calls as they go).
- :mod:`.stats`: ``Executor.stats()``'s snapshot of the meter and the workers;
  :mod:`.stats_server`, the ``Config.stats_socket`` endpoint that ``python -m mpx top`` reads.
- :mod:`.preflight`: the checks made before any worker starts.

The driver talks to worker processes only through the messages of :mod:`mpx.protocol.wire`. It may
import the queue and the layers below it, the shared modules (``mpx.protocol.wire``, ``mpx.config``,
``mpx.errors``, ``mpx.dumps``) and ``mpx._node`` (to start workers and lead other nodes),
never ``mpx._worker`` or ``mpx._cli``.
"""
