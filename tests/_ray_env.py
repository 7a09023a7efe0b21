"""An environment in which a Ray cluster started here sends nothing off 127.0.0.1: the Ray
launcher's tests use it, and so do the benchmarks that start Ray (bench/kit_procs.py loads
this file).

Every Ray head starts the dashboard process (with include_dashboard=False it loads only its
UsageStatsHead module), and that module, usage stats enabled or not, reads
``~/ray_bootstrap_config.yaml`` to learn the cloud provider; when the file is missing it
asks the cloud metadata address instead: HTTP to 169.254.169.254 (Azure, then AWS) and a
DNS lookup of metadata.google.internal through the system resolver. A HOME of our own
holding that file with ``provider: type: local`` answers the question without a packet.

With usage stats disabled, the same module still POSTs a "disabled" notice to
https://usage-stats.ray.io/ (a DNS lookup first) unless the cluster was started by a bare
ray.init() -- and ray.cluster_utils.Cluster's is not. Ray takes that URL from
RAY_USAGE_STATS_REPORT_URL: one with a scheme requests has no adapter for fails before any
socket is made (even through an http(s)_proxy), and Ray logs it at debug level.

The variables must be in ``os.environ`` before the head node starts: ray.cluster_utils
starts the GCS, the raylets and the dashboard as subprocesses of this process, and the
raylets' workers inherit the raylets' environment. Only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import site
import tempfile
from collections.abc import Iterator

BOOTSTRAP_CONFIG = "provider:\n  type: local\n"
# no connection adapter in requests for file://: the "usage stats disabled" POST goes nowhere
NO_REPORT_URL = "file:///dev/null"


@contextlib.contextmanager
def ray_loopback_env() -> Iterator[str]:
    """HOME (a fresh directory holding ``ray_bootstrap_config.yaml``),
    RAY_USAGE_STATS_ENABLED=0 and RAY_USAGE_STATS_REPORT_URL set in ``os.environ``, and
    restored on exit. Yields the HOME."""
    home = tempfile.mkdtemp(prefix="mpx-ray-home-")
    with open(os.path.join(home, "ray_bootstrap_config.yaml"), "w") as f:
        f.write(BOOTSTRAP_CONFIG)
    names = ("HOME", "RAY_USAGE_STATS_ENABLED", "RAY_USAGE_STATS_REPORT_URL", "PYTHONUSERBASE")
    saved = {k: os.environ.get(k) for k in names}
    # the user site-packages (~/.local/...) is found from HOME: keep Ray's processes
    # seeing the one this process sees
    user_base = site.getuserbase()
    os.environ["HOME"] = home
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_USAGE_STATS_REPORT_URL"] = NO_REPORT_URL
    if saved["PYTHONUSERBASE"] is None and user_base:
        os.environ["PYTHONUSERBASE"] = user_base
    try:
        yield home
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(home, ignore_errors=True)
