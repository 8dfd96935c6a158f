"""Every rendered text (reports, Slack blocks, prefect.yaml) comes from a jinja2 template."""

from __future__ import annotations

from functools import lru_cache

import jinja2


@lru_cache(maxsize=1)
def env() -> jinja2.Environment:
    e = jinja2.Environment(loader=jinja2.PackageLoader("ckptflow", "templates"),
                           undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                           keep_trailing_newline=True)
    e.filters["mib"] = lambda b: f"{(b or 0) / (1 << 20):,.1f} MiB"
    e.filters["secs"] = lambda s: "-" if s is None else f"{s:.2f} s"
    return e


def render(template: str, **ctx) -> str:
    """Render ``templates/<template>`` with ``ctx``.

    Example:
        >>> render("restore_report.md.j2", workload="w", node="n", result=None, error="boom")  # doctest: +SKIP
    """
    return env().get_template(template).render(**ctx)
