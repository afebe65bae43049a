"""`gpuwatch report`'s page in a real headless browser: Debian's Chromium (/usr/bin/chromium, which .ci/run installs)
driven by Playwright, no browser downloaded. Every request but the page's own file is blocked and recorded; any
console error or page error fails. Each chart must have drawn marks, each finding's link must lead to its view and
highlight its ranks, and the straggler, bubble and hang views must name the planted fault's rank. A screenshot of each
view is written under GPUWATCH_REPORT_SCREENSHOTS (else the test's tmp path), as an artifact to look at.

No timing assertion: how fast the page opens is benchmarks/report_size.py's business."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from playwright.sync_api import sync_playwright
from report_runs import (  # the session's run logs are conftest's fixtures
    HUNG,
    STRAGGLER,
)

from gpuwatch.report.cli import report

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
#: The views a run log of a finished pipeline job draws, each with marks.
VIEWS = ("findings", "heatmap", "phases", "bubble", "collectives", "curves", "memory", "ranks")


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not CHROMIUM.exists():
        pytest.fail("/usr/bin/chromium not found: install Debian's 'chromium' package (.ci/run does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


class Page:
    """The report of a run log, opened in the browser: its errors and the requests it tried are recorded."""

    def __init__(self, browser, run_log: Path, directory: Path, name: str) -> None:
        self.file = directory / f"{name}.html"
        result = CliRunner().invoke(report, ["--run-log", str(run_log), "-o", str(self.file)])
        assert result.exit_code == 0, result.output
        self.url = self.file.as_uri()
        self.errors: list[str] = []
        self.blocked: list[str] = []
        self.shots = Path(os.environ.get("GPUWATCH_REPORT_SCREENSHOTS") or directory) / name
        self.shots.mkdir(parents=True, exist_ok=True)
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.route("**/*", self._route)
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-ready]")

    def _route(self, route) -> None:
        if route.request.url == self.url:
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def attr(self, selector: str, name: str) -> str | None:
        return self.page.locator(selector).first.get_attribute(name)

    def marks(self, view: str) -> list[int]:
        return [int(node.get_attribute("data-marks")) for node in
                self.page.locator(f"#view-{view} [data-marks]").all()]

    def screenshot(self, view: str) -> None:
        self.page.locator(f"#view-{view}").screenshot(path=str(self.shots / f"{view}.png"))

    def close(self) -> None:
        self.page.close()
        assert self.errors == [], self.errors
        assert self.blocked == [], self.blocked


@pytest.fixture
def open_page(browser, tmp_path) -> Iterator:
    pages: list[Page] = []

    def open_(run_log: Path, name: str) -> Page:
        pages.append(Page(browser, run_log, tmp_path, name))
        return pages[-1]

    yield open_
    for page in pages:
        page.close()


def check_links(page: Page) -> None:
    """Each finding links to a view that exists; following it highlights the finding's ranks there."""
    findings = page.page.locator("article.finding").all()
    assert findings
    for finding in findings:
        link = finding.locator("a.evidence-link")
        view = link.get_attribute("data-view")
        ranks = link.get_attribute("data-ranks")
        link.click()
        target = "ranks" if page.page.locator(f"#view-{view}").count() == 0 else view
        assert page.page.locator(f"#view-{target}.focus").count() == 1, view
        if ranks and target == "heatmap":
            assert page.attr("#view-heatmap canvas", "data-highlighted") == ranks
        if ranks:
            for rank in ranks.split(","):
                assert page.page.locator(f'#view-ranks tr.hit[data-rank="{rank}"]').count() == 1


def test_the_straggler_page_draws_every_view_and_names_the_slow_rank(open_page, straggler_log):
    page = open_page(straggler_log, "straggler")
    for view in VIEWS[1:]:
        marks = page.marks(view)
        assert marks and all(count > 0 for count in marks), (view, marks)
        page.screenshot(view)
    page.screenshot("findings")
    assert page.attr("#view-heatmap canvas", "data-top-rank") == str(STRAGGLER)  # busy time, shown first
    assert page.attr("#view-heatmap canvas", "data-legend").startswith("½× 1× 2× 4× × the typical cell, ")
    # the page ran its scripts (it is ready) under a policy that allows those two, by hash, and no other
    policy = page.attr('meta[http-equiv="Content-Security-Policy"]', "content")
    scripts = policy.split("script-src ")[1].split(";")[0].split()
    assert len(scripts) == 2 and all(s.startswith("'sha256-") for s in scripts), policy
    # the generation time is not rounded with the measurements: the day the file was written, to the minute
    generated = page.page.locator("#summary").inner_text().rsplit("generated ", 1)[1]
    written = datetime.datetime.fromtimestamp(page.file.stat().st_mtime, datetime.UTC)
    assert abs(datetime.datetime.fromisoformat(generated) - written) < datetime.timedelta(minutes=1), generated
    assert page.attr("#view-phases canvas", "data-top-compute-rank") == str(STRAGGLER)
    link = page.page.locator('article[data-code="PERF002"] a.evidence-link')
    assert (link.get_attribute("data-view"), link.get_attribute("data-ranks")) == ("heatmap", str(STRAGGLER))
    check_links(page)
    page.page.screenshot(path=str(page.shots / "page.png"), full_page=True)


def test_the_bubble_view_shows_every_stage_measured_against_theory(open_page, bubble_log):
    page = open_page(bubble_log, "bubble")
    assert page.marks("bubble") == [8]  # 4 stages × (measured, theory)
    link = page.page.locator('article[data-code="PERF001"] a.evidence-link')
    assert link.get_attribute("data-view") == "bubble"
    check_links(page)
    page.screenshot("bubble")


def test_the_hang_view_names_the_hung_rank_and_who_waits_for_it(open_page, hang_log):
    page = open_page(hang_log, "hang")
    assert page.attr("#view-hang .chain", "data-culprits") == str(HUNG)
    culprit = page.page.locator("#view-hang tr.culprit")
    assert culprit.count() == 1 and culprit.get_attribute("data-rank") == str(HUNG)
    assert "waits in all_reduce (dp #" in page.page.locator("#view-hang .chain").inner_text()
    assert page.marks("hang")[0] == 4
    check_links(page)
    page.screenshot("hang")
