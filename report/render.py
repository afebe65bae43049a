"""Render: the model as one HTML file that needs no network. The chart library (uPlot, vendored under
``vendor/uplot`` with its licence, docs/report.md says why), the page's own script and style, and the data (the
model as JSON) are all inline, so the file can be mailed, attached to a ticket or opened offline."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from importlib import resources
from typing import Any

from gpuwatch.report.model import ReportModel

#: Significant digits kept of every number: a step time to 0.1 %, enough to see; the page's size halves.
DIGITS = 4
UPLOT_VERSION = "1.6.32"
#: The page may load nothing (every script and style is inline, so the browser refuses any fetch it would attempt)
#: and run only its own two scripts, named by their SHA-256 (CSP Level 2 hash sources): a script injected by a finding's
#: text, were the escaping ever to fail, would not run. Styles stay inline-allowed: uPlot sizes its elements with them.
CSP = "default-src 'none'; script-src {scripts}; style-src 'unsafe-inline'; img-src data:"
#: Keys of the model whose numbers are not measured (a timestamp): never rounded.
EXACT_SUFFIXES = ("_at",)


def _asset(name: str) -> str:
    return resources.files("gpuwatch.report").joinpath(name).read_text(encoding="utf-8")


def compact(value: Any, exact: bool = False) -> Any:
    """The model's measured numbers to ``DIGITS`` significant digits (a timestamp, ``*_at``, is kept whole: 4 digits
    of 1.8e9 seconds would move it by days), non-finite ones as null (JSON has none)."""
    if isinstance(value, float):
        return (value if exact else float(f"{value:.{DIGITS}g}")) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: compact(item, key.endswith(EXACT_SUFFIXES)) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [compact(item) for item in value]
    return value


def script_hash(script: str) -> str:
    """A CSP hash source for an inline script: 'sha256-' and the base64 of its text's SHA-256."""
    return f"'sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}'"


def _inline_json(data: Any) -> str:
    """JSON safe inside a <script> element: no ``</`` can close it, no ``<!--`` open a comment."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def render(model: ReportModel) -> str:
    title = html.escape(f"gpuwatch report: {model.job}")
    uplot, page = _asset("vendor/uplot/uPlot.iife.min.js"), _asset("page.js")
    policy = CSP.format(scripts=" ".join(script_hash(script) for script in (uplot, page)))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{policy}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<!-- uPlot {UPLOT_VERSION}, MIT licence (c) Leon Sorokin, https://github.com/leeoniya/uPlot -->
<style>{_asset("vendor/uplot/uPlot.min.css")}</style>
<style>{_asset("page.css")}</style>
</head><body>
<header><h1>{title}</h1><p id="summary"></p></header>
<main id="report"></main>
<script type="application/json" id="report-data">{_inline_json(compact(model.as_dict()))}</script>
<script>{uplot}</script>
<script>{page}</script>
</body></html>
"""
