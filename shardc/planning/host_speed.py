"""A cluster profile rescaled to this run's host speed (issue 19: the step-time prediction).

The host's speed on the GPU machines moves between machine starts, and a profile's host terms
are seconds measured on the start it was calibrated on. Calibration (profile version 9) stores
the host-speed probe (``ClusterProfile.host_probe_s``, :mod:`shardc.tools.host_probe`); a run
times the same probe again (:func:`shardc.tools.host_probe.agreed_host_probe`, the same value
on every rank) and :func:`with_host_speed` multiplies every host-seconds term by the ratio.

CPU offload's host step is priced at the profile's host AdamW rate
(``ClusterProfile.host_adamw_rate``), which the probe above does not scale (host memory
bandwidth, not the interpreter's speed) and which also moves between machine starts (one
H200 host: ~30%): :func:`with_host_adamw_rate` puts a rate timed at run time
(:func:`shardc.tools.host_adamw_probe.refine_host_adamw`) in its place.
"""

from __future__ import annotations

import dataclasses
import math

from shardc.planning.optimizer_kind import RAN
from shardc.planning.profile import HOST_SECONDS_FIELDS, ClusterProfile, ProfileError


def require_host_probe(profile: ClusterProfile) -> None:
    """Raise :class:`ProfileError` (naming the profile) where ``profile`` has no host probe
    (``host_probe_s`` 0: calibrated before profile version 9, or a preset not measured since),
    so that a run can refuse before it measures anything."""
    if not profile.host_probe_s > 0:
        raise ProfileError(f"shardc: cluster profile {profile.name!r} has no host probe "
                           "(host_probe_s is 0), so its host terms cannot be rescaled to this "
                           "host; recalibrate with python -m shardc calibrate to record a host "
                           "probe")


def host_speed_factor(profile: ClusterProfile, probe_s: float) -> float:
    """``probe_s`` over ``profile.host_probe_s``: how much longer the host's work takes now
    than when the profile was calibrated. Raises :class:`ProfileError` (naming the profile)
    where the profile has no probe (:func:`require_host_probe`) or ``probe_s`` is not a
    positive finite number of seconds."""
    require_host_probe(profile)
    if isinstance(probe_s, bool) or not isinstance(probe_s, (int, float)) \
            or not (math.isfinite(probe_s) and probe_s > 0):
        raise ProfileError(f"shardc: host probe of {probe_s!r} s for cluster profile "
                           f"{profile.name!r}: it must be a positive finite number of seconds")
    return probe_s / profile.host_probe_s


def with_host_speed(profile: ClusterProfile, probe_s: float) -> ClusterProfile:
    """``profile`` with every host-seconds term (:data:`HOST_SECONDS_FIELDS`; a
    ``compiled_launch_s`` of None stays None) and their fit's spread (``host_fit_spread``)
    multiplied by :func:`host_speed_factor`,
    ``host_probe_s`` set to ``probe_s``, the name suffixed ``+host x<factor>`` and a note giving
    the factor and both probes. Everything else is kept: the device's terms (matmul, attention,
    memory, ``kernel_gpu_s``, ``overlap_slowdown``), the collectives and links run on the
    device and the network; the host link is bound by the link, and the host AdamW rates by
    host memory bandwidth, not by the interpreter's speed that the probe measures. A probe
    equal to the profile's gives a profile with the same terms."""
    factor = host_speed_factor(profile, probe_s)
    changes: dict[str, object] = {}
    for name in HOST_SECONDS_FIELDS:
        value = getattr(profile, name)
        if value is not None:
            changes[name] = value * factor
    note = (f"host terms x{factor:.4f}: host probe {probe_s * 1e3:.3f} ms at run time over "
            f"{profile.host_probe_s * 1e3:.3f} ms at calibration")
    # The spread (version 10) is of the same seconds: it scales with them.
    changes["host_fit_spread"] = tuple((n, low * factor, high * factor)
                                       for n, low, high in profile.host_fit_spread)
    return dataclasses.replace(profile, **changes, host_probe_s=float(probe_s),
                               name=f"{profile.name}+host x{factor:.3f}",
                               notes=(*profile.notes, note))


def host_adamw_field(ran: str) -> str:
    """The profile field that prices the host AdamW implementation ``ran``
    (:data:`shardc.planning.optimizer_kind.RAN`, as ``ClusterProfile.host_adamw_rate`` reads
    it): ``host_adamw_params_per_s`` for ``"fused"``, ``host_adamw_per_tensor_params_per_s``
    for the others (foreach on host tensors loops over the same per-tensor kernels)."""
    if ran not in RAN:
        raise ProfileError(f"shardc: host AdamW implementation {ran!r} is not one of {RAN}")
    return "host_adamw_params_per_s" if ran == "fused" else "host_adamw_per_tensor_params_per_s"


def with_host_adamw_rate(profile: ClusterProfile, params_per_s: float,
                         ran: str = "per_tensor") -> ClusterProfile:
    """``profile`` with the host AdamW rate that prices ``ran`` (:func:`host_adamw_field`) set
    to ``params_per_s`` (a rate timed on this host, e.g. by
    :func:`shardc.tools.host_adamw_probe.refine_host_adamw`), the name suffixed ``+adamw <ran>
    <rate>`` and a note giving both rates. Every other term is kept (the other implementation's
    rate too: only the one the run steps with was timed). Raises :class:`ProfileError` where
    the rate is not a positive finite number."""
    field = host_adamw_field(ran)
    if isinstance(params_per_s, bool) or not isinstance(params_per_s, (int, float)) \
            or not (math.isfinite(params_per_s) and params_per_s > 0):
        raise ProfileError(f"shardc: host AdamW rate of {params_per_s!r} parameters/s for "
                           f"cluster profile {profile.name!r}: it must be a positive finite "
                           "number")
    before = profile.host_adamw_rate(ran)
    note = (f"{field} {params_per_s:.4g} parameters/s timed at run time ({ran}) in place of "
            f"{before:.4g}" + (f" (x{params_per_s / before:.3f})" if before > 0 else ""))
    return dataclasses.replace(profile, **{field: float(params_per_s)},
                               name=f"{profile.name}+adamw {ran} {params_per_s / 1e9:.3g}e9",
                               notes=(*profile.notes, note))
