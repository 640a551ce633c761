"""Install packages into the venv with uv, configured as pip is on this machine.

Why uv: `make setup` with pip took 2 min 9 s on 2 cores, most of it resolving and
byte-compiling; uv installs the same set (the same `pip freeze`) in about 15 s. Why this
script: uv reads none of pip's configuration, and a machine's package registry, local wheel
folders and constraints live there (`pip config list`). This reads pip's effective settings
and hands them to uv as its environment variables:

    pip option         uv variable
    index-url       -> UV_DEFAULT_INDEX
    extra-index-url -> UV_EXTRA_INDEX_URL      (pip's order of precedence, lowest first:
    find-links      -> UV_FIND_LINKS            global section, install section, PIP_*
    constraint      -> UV_CONSTRAINT            variables)
    trusted-host    -> UV_INSECURE_HOST
    cert            -> SSL_CERT_FILE

uv's default index strategy takes a package only from the first index that has it; pip
picks the best version across all of them, so this asks uv for pip's behaviour.

Byte-code is not compiled at install (compiling all 17k files costs 38 s, most are never
imported); the Makefile lets Python write it on first import instead.

Usage: python tools/uv_install.py <uv pip install arguments>
"""

import os
import subprocess
import sys

_UV_VARIABLE = {
    "index-url": "UV_DEFAULT_INDEX",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "trusted-host": "UV_INSECURE_HOST",
    "cert": "SSL_CERT_FILE",
}
# Lowest precedence first: a later section's value replaces an earlier one's.
_SECTIONS = ("global", "install", ":env:")
# uv separates the values of these with commas; pip separates all of them with spaces.
_COMMA_SEPARATED = {"UV_FIND_LINKS"}


def pip_settings() -> dict[str, str]:
    """Effective values of pip's options, as `pip config list` prints them."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    by_section: dict[str, dict[str, str]] = {section: {} for section in _SECTIONS}
    for line in listing.splitlines():
        key, _, quoted = line.partition("=")
        section, _, option = key.rpartition(".")
        if section in by_section:
            by_section[section][option] = quoted.strip("'\"")
    settings: dict[str, str] = {}
    for section in _SECTIONS:
        settings.update(by_section[section])
    return settings


def uv_environment(settings: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")
    for option, variable in _UV_VARIABLE.items():
        if option in settings and variable not in env:
            values = settings[option].split()
            env[variable] = (",".join if variable in _COMMA_SEPARATED else " ".join)(values)
    return env


def main() -> None:
    env = uv_environment(pip_settings())
    command = [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable]
    sys.exit(subprocess.run([*command, *sys.argv[1:]], env=env).returncode)


if __name__ == "__main__":
    main()
