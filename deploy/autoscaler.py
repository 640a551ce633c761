"""The autoscaler: a detached Ray actor per app that reads the service and moves P:D.

    every interval_s:  GET /stats ─▶ ServiceWindow ─▶ ScalingPolicy.decide
                                                      │ a role to change
                                                      ▼
                       cluster.scale(app, P', D')  (what `pdserve scale` runs: kept workers
                                                    keep their caches; removed ones drain)

It reads the figures an operator sees (the gateway's ``/stats``, through Serve's proxy, with
the app's key), so several gateway replicas read as one service, and it acts through the
same step as the CLI: a scale-down redeploys with the leaving workers unrouted, waits until
they hold no request and no lease, and only then stops them. No request fails for a step.

``deploy()`` starts it when the app's config has ``autoscaling`` and no autoscaler runs for
the app (a scale step it takes redeploys through ``deploy()`` too, and finds it);
``delete_app`` stops it. The gateway reads its report (``gateway/autoscaler_view.py``). The counts it starts from are the app's stored config's, read at
every step, so a manual ``pdserve scale`` in between is respected. Its decisions, the
workers per role over time and its state are what ``report()`` returns: the gateway shows
them in ``/stats``, ``/metrics`` and the dashboard.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pdserve.deploy.autoscaling_config import AutoscalingConfig
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.scaling_policy import RoleTarget, ScalingPolicy
from pdserve.deploy.service_window import ROLES, ServiceSample, ServiceWindow
from pdserve.gateway.autoscaler_view import NAMESPACE, autoscaler_name
from pdserve.messages.scaling_decision import AutoscalerReport, ScalingDecision

logger = logging.getLogger(__name__)

_KEPT_DECISIONS = 200
_KEPT_HISTORY = 3600  # readings: two hours at the default interval


class Autoscaler:
    """The loop, on a thread of its own so that ``report()`` answers during a scale step."""

    def __init__(self, config: PDServeConfig) -> None:
        if config.autoscaling is None:
            raise ValueError(f"{config.app_name!r} has no autoscaling settings")
        self.app_name = config.app_name
        self.settings: AutoscalingConfig = config.autoscaling
        self.policy = ScalingPolicy(self.settings)
        self.window = ServiceWindow(self.settings.look_back_s)
        self._client = _stats_client(config)
        self._lock = threading.Lock()
        self._report = AutoscalerReport(
            self.app_name, "watching", config.num_prefill, config.num_decode
        )
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    def report(self) -> AutoscalerReport:
        with self._lock:
            return AutoscalerReport(
                self._report.app_name,
                self._report.state,
                self._report.prefill,
                self._report.decode,
                list(self._report.decisions),
                list(self._report.history),
                dict(self._report.decisions_by_direction),
                self._report.last_error,
            )

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        """Until the actor is killed (``stop_autoscaler``)."""
        while True:
            time.sleep(self.settings.interval_s)
            try:
                self._tick()
            except Exception as error:  # noqa: BLE001  # a bad reading must not end the loop
                logger.warning("autoscaler for %r: %s", self.app_name, error)
                with self._lock:
                    self._report.last_error = f"{type(error).__name__}: {error}"

    def _tick(self) -> None:
        config = self._stored_config()
        body = self._client.get("/stats")
        self.window.add(ServiceSample.from_stats(body, time.monotonic()))
        with self._lock:
            self._report.prefill, self._report.decode = config.num_prefill, config.num_decode
            self._report.history.append((time.time(), config.num_prefill, config.num_decode))
            del self._report.history[:-_KEPT_HISTORY]
        windows = [w for w in (self.window.role(role) for role in ROLES) if w is not None]
        # A worker that did not answer (restarting), or a step someone else runs: wait.
        counts = {"prefill": config.num_prefill, "decode": config.num_decode}
        if any(w.workers != counts[w.role] for w in windows):
            return
        steps = self.policy.decide(windows, time.monotonic())
        if steps:
            self._step(config, steps)

    def _step(self, config: PDServeConfig, steps: list[RoleTarget]) -> None:
        from pdserve.deploy.cluster import scale

        counts = {"prefill": config.num_prefill, "decode": config.num_decode}
        now = time.time()
        decisions = [
            ScalingDecision(now, step.role, step.current, step.workers, step.reason)
            for step in steps
        ]
        for step in steps:
            counts[step.role] = step.workers
        summary = ", ".join(f"{d.role} {d.workers_from} -> {d.workers_to}" for d in decisions)
        for decision in decisions:
            logger.info(
                "autoscaler for %r: %s %d -> %d: %s",
                self.app_name,
                decision.role,
                decision.workers_from,
                decision.workers_to,
                decision.reason,
            )
        with self._lock:
            self._report.state = f"scaling: {summary}"
            self._report.decisions.extend(decisions)
            del self._report.decisions[:-_KEPT_DECISIONS]
            for decision in decisions:
                key = f"{decision.role}:{decision.direction}"
                self._report.decisions_by_direction[key] = (
                    self._report.decisions_by_direction.get(key, 0) + 1
                )
        try:
            scale(self.app_name, counts["prefill"], counts["decode"])
        finally:
            self.window.clear()  # measures of the old shape would mislead the next decision
            with self._lock:
                self._report.state = "watching"
                self._report.prefill, self._report.decode = counts["prefill"], counts["decode"]

    def _stored_config(self) -> PDServeConfig:
        from pdserve.deploy.cluster import stored_config

        return stored_config(self.app_name)


def _stats_client(config: PDServeConfig) -> Any:
    from pdserve.deploy.cluster import base_url
    from pdserve.deploy.http_client import ServiceClient

    keys = config.admin_api_key or config.api_key
    return ServiceClient(
        base_url(config),
        timeout_s=30.0,
        api_key=keys[0] if keys else None,
        ca_bundle=config.ssl_certfile,
    )


def ensure_autoscaler(config: PDServeConfig) -> None:
    """Starts the app's autoscaler when its config asks for one and none runs; stops a
    running one when the config no longer asks."""
    import ray

    name = autoscaler_name(config.app_name)
    try:
        running = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        running = None
    if config.autoscaling is None:
        if running is not None:
            stop_autoscaler(config.app_name)
        return
    if running is None:
        actor = ray.remote(num_cpus=0)(Autoscaler)
        actor.options(
            name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote(config)


def stop_autoscaler(app_name: str) -> None:
    """Stops the app's autoscaler, if one runs (its step under way, if any, is cut off)."""
    import ray

    try:
        actor = ray.get_actor(autoscaler_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return
    ray.kill(actor)
