"""Closed forms for checkpoint-restart, to check the simulator against (all times in hours)."""

from __future__ import annotations

import math


def young_daly_interval(save_hours: float, job_mtbf_hours: float) -> float:
    """Young/Daly first-order optimal compute time between checkpoints: sqrt(2 * delta * MTBF)."""
    return math.sqrt(2.0 * save_hours * job_mtbf_hours)


def checkpoint_restart_ettr(interval_hours: float, save_hours: float, restart_hours: float,
                            job_mtbf_hours: float) -> float:
    """First-order ETTR of checkpoint-restart, exactly:

        ETTR = 1 - delta / tau - (tau / 2 + R) / MTBF

    with tau = compute time between checkpoints, delta = save time, R = restart + load time and MTBF
    the job's mean time between failures. delta/tau is the checkpoint overhead; each failure loses on
    average half an interval of work plus R. Valid when delta, R << tau << MTBF (it neglects failures
    during saves and restarts and the second-order terms); with tau = young_daly_interval it gives
    1 - sqrt(2 * delta / MTBF) - R / MTBF.
    """
    return 1.0 - save_hours / interval_hours - (interval_hours / 2.0 + restart_hours) / job_mtbf_hours


def checkpoint_restart_ettr_exponential(interval_hours: float, save_hours: float, restart_hours: float,
                                        job_mtbf_hours: float) -> float:
    """ETTR of checkpoint-restart under Poisson failures striking at any time (also during saves and
    restarts), with a replacement GPU always at hand, exactly:

        ETTR = tau / (MTBF * exp(R / MTBF) * (exp((tau + delta) / MTBF) - 1))

    Why: a segment of tau compute + delta save counts only if it runs without a failure; a restart of
    length R likewise. With rate 1/MTBF the expected wall time to get one segment through is
    (MTBF + Y) * (exp((tau + delta) / MTBF) - 1), Y = MTBF * (exp(R / MTBF) - 1) being the expected time
    to get one restart through. Its first-order expansion is checkpoint_restart_ettr; this form stays
    accurate when tau and R are not small against the MTBF (e.g. 100k-GPU jobs).
    """
    mtbf = job_mtbf_hours
    return interval_hours / (mtbf * math.exp(restart_hours / mtbf)
                             * math.expm1((interval_hours + save_hours) / mtbf))
