"""Drives the admin page in headless Chromium (Debian's, through Playwright's
`executable_path`): signs in with the admin key, waits for the occupancy chart, shows a
session's block strip (with each block's attention mass), the prefetch figures and a memory
node's neighbourhood, runs a tier cycle and a shadow flush from the page, checks that the key
is in sessionStorage only and that no Content-Security-Policy violation or script error
happened, and writes a screenshot.

usage: admin_page.py BASE ADMIN_KEY TENANT_ID AGENT SESSION NODE_ID SCREENSHOT"""

import json
import os
import sys

from playwright.sync_api import sync_playwright


def main() -> None:
    base, admin, tenant, agent, session, node, shot = sys.argv[1:8]
    chromium = os.environ.get("ENGRAM_CHROMIUM", "/usr/bin/chromium")
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        # The wrong key's 401 is expected; any other console error (a CSP violation, a failed
        # asset, a script error) is a problem.
        page.on(
            "console",
            lambda m: problems.append(m.text) if m.type == "error" and "status of 401" not in m.text else None,
        )
        page.on("pageerror", lambda e: problems.append(str(e)))
        response = page.goto(f"{base}/admin")
        csp = response.headers.get("content-security-policy", "")
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp, csp

        # A wrong key is refused; the right one signs in.
        page.fill("#admin-key", "wrong-key-0123456789")
        page.click("#sign-in")
        page.wait_for_selector("#login-error")
        page.fill("#admin-key", admin)
        page.click("#sign-in")
        page.wait_for_selector("#occupancy svg polyline", state="attached")
        page.wait_for_selector("#hot-used")
        stored = page.evaluate("() => [sessionStorage.getItem('engram-admin-key'), localStorage.length, document.cookie]")
        assert stored == [admin, 0, ""], stored

        # The session's blocks.
        page.select_option("#strip-tenant", tenant)
        page.fill("#strip-agent", agent)
        page.fill("#strip-session", session)
        page.click("#strip-show")
        page.wait_for_selector("#strip .block")
        blocks = page.eval_on_selector_all(
            "#strip .block",
            "els => els.map(e => [e.dataset.source, e.dataset.tier, e.dataset.pin, Number(e.dataset.mass), Number(e.dataset.reads)])",
        )
        sources = sorted({b[0] for b in blocks})
        pinned = sum(1 for b in blocks if b[2] == "pinned")
        assert "axioms" in sources and "user_turn" in sources, sources
        assert pinned > 0, blocks
        # Decode steps sampled attention mass: some blocks carry it and were read, and the
        # bars are drawn in proportion (the largest fills its block).
        masses = [b[3] for b in blocks]
        assert all(0.0 <= m <= 1.0 for m in masses) and max(masses) > 0.0, masses
        assert sum(b[4] for b in blocks) > 0, blocks
        tallest = page.eval_on_selector_all("#strip .block .mass", "els => Math.max(...els.map(e => parseFloat(e.style.height)))")
        assert abs(tallest - 100.0) < 1e-6, tallest

        # The query-time prefetch the test made before.
        page.wait_for_selector("#prefetch")
        reserved = page.text_content("#prefetch-reserved")
        assert reserved == "1", reserved

        # A memory node's neighbourhood.
        page.select_option("#node-tenant", tenant)
        page.fill("#node-id", node)
        page.click("#memory button[type=submit]")
        page.wait_for_selector("#memory svg circle")
        circles = page.eval_on_selector_all("#memory svg circle", "els => els.length")
        assert circles >= 2, circles

        # Actions.
        page.click("#run-cycle")
        page.wait_for_function("() => document.querySelector('#cycle-result').textContent.startsWith('cycle ')")
        page.click("#flush")
        page.wait_for_function("() => document.querySelector('#flush-result').textContent.startsWith('flushed')")

        page.wait_for_timeout(2500)  # a second occupancy sample
        page.screenshot(path=shot, full_page=True)
        browser.close()
    assert not problems, problems
    print("admin page ok " + json.dumps({"blocks": len(blocks), "pinned": pinned, "sources": sources, "circles": circles, "max_mass": max(masses)}))


if __name__ == "__main__":
    main()
