"""``symbiosis keys``: make a CURVE key pair for an executor or a client (``transport/security.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def keys(
    output: Annotated[
        Path,
        typer.Option(
            help="Folder to write NAME.key (public) and NAME.key_secret (secret, mode 0600) into; created if missing."
        ),
    ],
    name: Annotated[
        str, typer.Option(help="Base name of the key files, e.g. 'server' or the client's name.")
    ] = "client",
) -> None:
    """Generate a CURVE key pair. Give NAME.key to the other side; keep NAME.key_secret.

    Executor: `symbiosis serve --curve-secret-key server.key_secret --authorized-clients DIR`, with
    each client's NAME.key copied into DIR. Client: set SYMBIOSIS_CURVE_SERVER_KEY=server.key and
    SYMBIOSIS_CURVE_CLIENT_KEY=NAME.key_secret (or pass curve=CurveClientKeys(...) in Python).
    """
    from symbiosis.transport.security import generate_keypair

    public, secret = generate_keypair(output, name)
    typer.echo(f"wrote public key {public} and secret key {secret}")


def register(app: typer.Typer) -> None:
    app.command("keys")(keys)
