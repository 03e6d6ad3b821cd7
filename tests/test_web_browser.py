"""The node's web page in a real browser (slow): headless Chromium, driven by selenium through
chromedriver (Debian's ``chromium`` and ``chromium-driver`` packages, which ``.ci/run`` installs
as README "Tests" says), against an in-process network (ps_p2p.testing.localnet) whose first
user serves its local API.

It checks that the network page lists the model nodes and that a chat message gets a streamed
answer signed by the model node, and saves two screenshots (web.png, web-chat.png) in the folder
``PS_WEB_SCREENSHOTS`` names (``PS_WEB_SCREENSHOTS=docs`` refreshes the ones the README shows),
else in a temporary folder, so a test run never rewrites tracked files. The model nodes serve the shared TinyStories model when ``../shared`` has it
(the screenshot then shows a real answer), else :class:`~ps_p2p.testing.fakes.InstantEngine`.
Skipped, with the reason, when chromium, chromedriver or selenium is absent.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest
import trio

from ps_p2p import devnet
from ps_p2p.api.openai_compat import serve_api
from ps_p2p.api.web import network_view
from ps_p2p.testing.fakes import InstantEngine
from ps_p2p.testing.localnet import open_localnet

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MODEL = "stories260K"


def _engine(i: int):  # type: ignore[no-untyped-def]
    """The shared TinyStories model on CPU when present, else an instant fake of the same ID."""
    path = devnet.shared_dir(os.environ, REPO) / "models" / MODEL
    if not path.is_dir():
        return InstantEngine(MODEL)
    from ps_p2p.engines import load_engine

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return load_engine("transformers", model=str(path), device="cpu")


def _screenshots() -> pathlib.Path:
    """The folder for the screenshots: ``$PS_WEB_SCREENSHOTS`` (relative to the repository),
    else a fresh temporary folder."""
    named = os.environ.get("PS_WEB_SCREENSHOTS")
    folder = REPO / named if named else pathlib.Path(tempfile.mkdtemp(prefix="ps_p2p-web-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _browser():  # type: ignore[no-untyped-def]
    if not (pathlib.Path(CHROMIUM).exists() and pathlib.Path(CHROMEDRIVER).exists()):
        pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver; "
                    ".ci/run installs them when run as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the test extra)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,760", "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)


def _drive(url: str, expected_peers: set[str]) -> dict[str, object]:
    """In a worker thread (selenium blocks): open the pages, chat once, take the screenshots."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = _browser()
    try:
        driver.get(url + "/web")
        WebDriverWait(driver, 30).until(
            ec.presence_of_element_located((By.CSS_SELECTOR, "tr.model-node")))
        rows = driver.find_elements(By.CSS_SELECTOR, "tr.model-node")
        page = {
            "peers": {r.get_attribute("data-peer-id") for r in rows},
            "groups": [h.text for h in driver.find_elements(By.CSS_SELECTOR, "h3.model-id")],
            "organizations": [r.find_element(By.CLASS_NAME, "organization").text for r in rows],
        }
        shots = _screenshots()
        driver.save_screenshot(str(shots / "web.png"))

        driver.get(url + "/web/chat")
        box = WebDriverWait(driver, 30).until(
            ec.presence_of_element_located((By.ID, "prompt")))
        box.send_keys("Tell me a story about a fox")
        driver.find_element(By.ID, "send").click()
        meta = WebDriverWait(driver, 60).until(
            ec.presence_of_element_located((By.CSS_SELECTOR, ".meta.verified, .meta.error")))
        bubble = driver.find_element(By.CSS_SELECTOR, ".msg.assistant")
        chat = {
            "meta": meta.text,
            "meta_class": meta.get_attribute("class"),
            "served_by": meta.get_attribute("data-served-by"),
            "answer": bubble.text,
            "chunks": int(bubble.get_attribute("data-chunks") or 0),
        }
        driver.save_screenshot(str(shots / "web-chat.png"))
        return {"page": page, "chat": chat, "expected": expected_peers}
    finally:
        driver.quit()


async def test_the_page_shows_the_model_nodes_and_a_chat_gets_a_streamed_signed_answer():
    _browser().quit()  # skip before the network starts when there is no browser
    organizations = ["Acme Labs", "Beta <b>University</b>"]  # the second one, escaped
    async with open_localnet(
        users=6, models=2, engine_factory=_engine,
        model_organization=lambda i: organizations[i],
    ) as net:
        user = net.users[0]
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_api, user, "127.0.0.1:0")
            models = {m.keys.identity.peer_id_str for m in net.models}
            seen = await trio.to_thread.run_sync(_drive, url, models)
            model_view = network_view(net.models[0])
            nursery.cancel_scope.cancel()

    page, chat = seen["page"], seen["chat"]
    assert page["peers"] == models
    assert page["groups"][0].startswith(MODEL)
    assert sorted(page["organizations"]) == sorted(organizations)  # shown as text, not markup
    assert "verified" in chat["meta_class"], chat["meta"]
    assert chat["served_by"] in models
    assert "signature verified" in chat["meta"]
    assert chat["answer"]
    assert chat["chunks"] >= 2  # streamed: shown piece by piece as the model node generates it
    own = next(n for g in model_view["models"] for n in g["nodes"] if n["self"])
    assert own["load"]["source"] == "own"
    assert own["load"]["capacity"] >= 1
