"""A js-libp2p node dials a ps_p2p host (TCP + Noise + Yamux, with the py-libp2p work-arounds of
ps_p2p.protocols.libp2p_patches installed), pings it and identifies it (issue 22: the patches
change no byte on the wire, so another implementation still talks to us).

Needs Node.js and the npm packages ``libp2p @chainsafe/libp2p-noise @chainsafe/libp2p-yamux
@libp2p/tcp @libp2p/identify @libp2p/ping``, installed OUTSIDE this repository; the test looks
for them in ``$PS_JS_LIBP2P_DIR/node_modules`` and skips (saying why) when Node.js or a package
is missing. To run it::

    mkdir -p ~/.cache/ps_p2p-js && cd ~/.cache/ps_p2p-js && npm init -y && npm install libp2p \\
        @chainsafe/libp2p-noise @chainsafe/libp2p-yamux @libp2p/tcp @libp2p/identify @libp2p/ping
    PS_JS_LIBP2P_DIR=~/.cache/ps_p2p-js python -m pytest tests/test_js_interop.py
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import trio

from ps_p2p.keys import NodeKeys
from ps_p2p.protocols import libp2p_patches
from ps_p2p.protocols.host import listen_multiaddrs, open_host

PACKAGES = (
    "libp2p", "@chainsafe/libp2p-noise", "@chainsafe/libp2p-yamux", "@libp2p/tcp",
    "@libp2p/identify", "@libp2p/ping", "@multiformats/multiaddr",
)

#: Node 20 lacks Promise.withResolvers (Node 22), which current js-libp2p uses; imported first
POLYFILL = r"""
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function () {
    let resolve, reject
    const promise = new Promise((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
"""

SCRIPT = r"""
import './polyfill.mjs'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { multiaddr } from '@multiformats/multiaddr'

const target = multiaddr(process.argv[2])
const node = await createLibp2p({
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: { identify: identify(), ping: ping() },
})
await node.start()
const identified = new Promise((resolve) => {
  node.addEventListener('peer:identify', (event) => resolve(event.detail))
})
const connection = await node.dial(target)
const rtts = []
for (let i = 0; i < 3; i++) rtts.push(await node.services.ping.ping(target))
const result = await identified
console.log(JSON.stringify({
  remote: connection.remotePeer.toString(),
  rtts,
  protocols: result.protocols,
  agent: result.agentVersion ?? null,
}))
await node.stop()
"""


def _js_dir() -> pathlib.Path:
    """The folder whose node_modules holds the packages; skips the test when there is none."""
    if shutil.which("node") is None:
        pytest.skip("Node.js (node) is not installed")
    configured = os.environ.get("PS_JS_LIBP2P_DIR")
    if not configured:
        pytest.skip("PS_JS_LIBP2P_DIR is not set (a folder outside the repo where the js-libp2p "
                    "packages are npm-installed; see the module docstring)")
    folder = pathlib.Path(configured).expanduser()
    missing = [p for p in PACKAGES if not (folder / "node_modules" / p / "package.json").is_file()]
    if missing:
        pytest.skip(f"js-libp2p packages missing under {folder}/node_modules: {missing}")
    return folder


@pytest.mark.slow
async def test_a_js_libp2p_node_dials_pings_and_identifies_a_ps_p2p_host(tmp_path):
    folder = _js_dir()
    assert {"lean_yamux", "bufread"} <= set(libp2p_patches.installed())
    # the script beside a link to the packages: Node resolves ES module imports from the
    # script's folder upwards
    (tmp_path / "node_modules").symlink_to(folder / "node_modules", target_is_directory=True)
    script = tmp_path / "dial.mjs"
    script.write_text(SCRIPT)
    (tmp_path / "polyfill.mjs").write_text(POLYFILL)
    keys = NodeKeys.generate()
    async with open_host(keys.identity, ["/ip4/127.0.0.1/tcp/0"]) as host:
        (address,) = listen_multiaddrs(host)
        with trio.fail_after(60):
            done = await trio.run_process(
                ["node", str(script), address], capture_stdout=True, capture_stderr=True,
                check=False, cwd=tmp_path,
            )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert result["remote"] == host.get_id().to_base58()
    assert len(result["rtts"]) == 3 and all(rtt >= 0 for rtt in result["rtts"])
    assert {"/ipfs/ping/1.0.0", "/ipfs/id/1.0.0"} <= set(result["protocols"])
