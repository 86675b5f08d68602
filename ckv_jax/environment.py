"""The CKV_JAX_* environment variables: one parser per kind of value."""
from __future__ import annotations

import logging
import os
from typing import Mapping

log = logging.getLogger("ckv_jax")

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def env_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """`name` as a boolean (1/0, true/false, yes/no, on/off, any case); unset or blank: `default`."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"{name}: expected 0/1/true/false, got {raw!r}")


def env_int(name: str, default: int, environ: Mapping[str, str] | None = None, *,
            negative_to_zero: bool = False) -> int:
    """`name` as a non-negative int; unset or blank: `default`.  A negative value raises, or with
    `negative_to_zero` becomes 0 with a warning (as upstream treats its prefetch knobs)."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    if value < 0:
        if not negative_to_zero:
            raise ValueError(f"{name}: expected a non-negative integer, got {value}")
        log.warning("%s=%d is negative; using 0", name, value)
        return 0
    return value
