"""Azure Blob storage for tests: Azurite (Microsoft's Azure Storage emulator, from npm) on loopback,
with an account of its own whose key is made per start, reached through the environment variables
training/storage.py reads (never a URI or a config)."""

import base64
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from aws import free_port

from training.storage import AZURE_ENDPOINT_ENV, AZURE_KEY_ENV

ACCOUNT = "raytests"
AZURITE_VERSION = "3.35.0"  # (the Makefile's setup installs this one)
# Where `make setup` puts it: next to the virtualenv's Python, so that `make clean` removes it too.
LOCAL_BIN = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"


def missing() -> str | None:
    """Why Azurite cannot run here (what to install), or None."""
    if shutil.which("node") is None:
        return ("needs Node.js 18+ for Azurite (the Azure Storage emulator): install Node "
                "(apt-get install nodejs npm), then `make setup`")
    if not LOCAL_BIN.exists() and shutil.which("azurite-blob") is None:
        return (f"needs Azurite: `make setup` installs it where Node is present, or "
                f"`npm install --prefix {LOCAL_BIN.parents[2]} azurite@{AZURITE_VERSION}`")
    return None


@contextmanager
def azurite():
    """An Azurite Blob service in a temporary folder; yields the environment that reaches it (account
    key and endpoint), to be set for the processes that use it. Stopped, and its folder removed, after."""
    binary = str(LOCAL_BIN) if LOCAL_BIN.exists() else shutil.which("azurite-blob")
    key = base64.b64encode(secrets.token_bytes(64)).decode()
    port, folder = free_port(), tempfile.mkdtemp(prefix="azurite-")
    process = subprocess.Popen([binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", folder,
                                "--silent", "--disableTelemetry", "--skipApiVersionCheck", "--loose"],
                               env={**os.environ, "AZURITE_ACCOUNTS": f"{ACCOUNT}:{key}"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("Azurite did not start")
                time.sleep(0.2)
        yield {AZURE_KEY_ENV: key, AZURE_ENDPOINT_ENV: f"http://127.0.0.1:{port}"}
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)
