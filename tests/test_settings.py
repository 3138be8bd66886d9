"""The settings file: defaults, round trips, clear errors, atomic and careful saves."""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path

import pydantic
import pytest

from chatapp import settings as settings_mod
from chatapp.settings import (
    DEFAULT_KEYS,
    RemoteEndpoint,
    Settings,
    SettingsError,
    load,
    load_or_default,
    save,
    settings_path,
)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "settings.toml"


def write(path: Path, text: str) -> None:
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")


def test_missing_file_gives_defaults_without_creating_it(path):
    s = load(path)
    assert s == Settings()
    assert s.theme == "textual-dark" and s.default_model is None
    assert s.engine.kv_cache_memory_gib is None
    assert (s.server.host, s.server.port, s.server.api_key) == ("127.0.0.1", 8000, None)
    assert s.endpoints == [] and s.keys == dict(DEFAULT_KEYS)
    assert not path.exists()


def test_default_location_is_the_config_dir():
    assert settings_path() == Path(os.environ["CHATAPP_CONFIG_DIR"]) / "settings.toml"
    s = Settings(theme="nord")
    assert save(s) == settings_path()
    assert load().theme == "nord"


def test_round_trip(path):
    s = Settings(default_model="SmolLM2-135M-Instruct", theme="dracula")
    s.engine.kv_cache_memory_gib = 2.5
    s.server.port = 9000
    s.server.api_key = "local-secret"
    s.endpoints.append(RemoteEndpoint(name="openai", base_url="https://api.openai.com/v1", api_key="sk-x"))
    s.keys["new_session"] = "ctrl+g"
    save(s, path)
    assert load(path) == s
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it may hold API keys
    assert load(path).endpoint("openai").api_key == "sk-x"
    assert load(path).endpoint("nope") is None


def test_a_hand_written_file_is_read(path):
    write(
        path,
        """
        default_model = "my-model"
        theme = "nord"

        [engine]
        kv_cache_memory_gib = 4  # an integer is fine for GiB

        [server]
        port = 8080

        [[endpoints]]
        name = "work"
        base_url = "http://gpu-box:8000/v1"
    """,
    )
    s = load(path)
    assert (s.default_model, s.theme, s.engine.kv_cache_memory_gib) == ("my-model", "nord", 4.0)
    assert (s.server.host, s.server.port) == ("127.0.0.1", 8080)
    assert s.endpoints == [RemoteEndpoint(name="work", base_url="http://gpu-box:8000/v1")]


def test_remapped_keys_keep_defaults_for_the_rest(path):
    write(
        path,
        """
        [keys]
        new_session = "ctrl+g"
        quit = "ctrl+q,ctrl+c"
        export = ""
    """,
    )
    keys = load(path).keys
    assert keys["new_session"] == "ctrl+g"
    assert keys["quit"] == "ctrl+q,ctrl+c"
    assert keys["export"] == ""  # unbound
    assert keys["search"] == DEFAULT_KEYS["search"]
    assert set(keys) == set(DEFAULT_KEYS)


def test_unknown_keys_are_kept_when_saving(path):
    write(
        path,
        """
        theme = "nord"
        from_the_future = [1, 2]

        [server]
        port = 8001
        tls = true

        [plugins.weather]
        city = "Oslo"

        [keys]
        teleport = "ctrl+y"
    """,
    )
    s = load(path)
    assert s.unknown_actions() == ["teleport"]
    s.theme = "gruvbox"
    save(s, path)
    again = load(path)
    assert again.theme == "gruvbox" and again.server.port == 8001
    assert again.model_extra == {"from_the_future": [1, 2], "plugins": {"weather": {"city": "Oslo"}}}
    assert again.server.model_extra == {"tls": True}
    assert again.keys["teleport"] == "ctrl+y"


def test_bad_toml_names_the_file_and_line(path):
    write(
        path,
        """
        theme = "nord"

        [server]
        port = 80 80
    """,
    )
    with pytest.raises(SettingsError) as info:
        load(path)
    assert str(path) in str(info.value) and "line 4" in str(info.value) and "not valid TOML" in str(info.value)
    assert info.value.line == 4 and info.value.path == path


@pytest.mark.parametrize(
    "text, field, line, fragment",
    [
        ('theme = "nord"\n[server]\nport = "8080"\n', "server.port", 3, "valid integer"),
        ("[server]\nport = 70000\n", "server.port", 2, "less than or equal to 65535"),
        ("[server]\nport = true\n", "server.port", 2, "valid integer"),
        ("[engine]\nkv_cache_memory_gib = -1\n", "engine.kv_cache_memory_gib", 2, "greater than 0"),
        ('theme = ""\n', "theme", 1, "at least 1 character"),
        ("default_model = 3\n", "default_model", 1, "valid string"),
        ("server = 5\n", "server", 1, "ServerSettings"),
        (
            '[[endpoints]]\nname = "a"\nbase_url = "http://a"\n[[endpoints]]\nname = "b"\nbase_url = "b.com"\n',
            "endpoints[1].base_url",
            6,
            "http:// or https://",
        ),
        ('[[endpoints]]\nname = "a"\n', "endpoints[0].base_url", 1, "required"),
        (
            '[[endpoints]]\nname = "a"\nbase_url = "http://a"\n[[endpoints]]\nname = "a"\nbase_url = "http://b"\n',
            "endpoints",
            1,
            "named 'a'",
        ),
        ('[keys]\nquit = "ctrl q"\n', "keys.quit", 2, "not a key"),
        ("[keys]\nquit = 5\n", "keys.quit", 2, "valid string"),
        ('[keys]\nsearch = "ctrl+t"\n', "keys", 1, "'ctrl+t' is bound to both"),
    ],
)
def test_bad_values_name_the_field_and_line(path, text, field, line, fragment):
    path.write_text(text)
    with pytest.raises(SettingsError) as info:
        load(path)
    assert info.value.field == field
    assert info.value.line == line
    assert fragment in str(info.value)
    assert str(info.value).startswith(str(path))


def test_secrets_are_not_echoed_in_errors(path):
    path.write_text("[server]\napi_key = 123456789\n")
    with pytest.raises(SettingsError) as info:
        load(path)
    assert "server.api_key" in str(info.value) and "123456789" not in str(info.value)


def test_unreadable_file_gives_a_clear_error(path):
    path.write_bytes(b'theme = "\xff\xfe"\n')
    with pytest.raises(SettingsError, match="cannot read the settings file"):
        load(path)


def test_load_or_default_falls_back_without_touching_the_file(path):
    path.write_text('theme = "nord"\n[server]\nport = "x"\n')
    s, error = load_or_default(path)
    assert s == Settings() and isinstance(error, SettingsError) and error.field == "server.port"
    assert load_or_default(path.with_name("absent.toml")) == (Settings(), None)
    # The app runs on the defaults; saving them must not destroy the user's file.
    with pytest.raises(SettingsError, match="not saving over"):
        save(s, path)
    assert path.read_text() == 'theme = "nord"\n[server]\nport = "x"\n'


def test_forced_save_keeps_a_copy_of_the_broken_file(path):
    path.write_text("this is = = broken\n")
    save(Settings(theme="nord"), path, force=True)
    assert load(path).theme == "nord"
    assert path.with_name("settings.toml.broken").read_text() == "this is = = broken\n"


def test_save_is_atomic_when_the_swap_fails(path, monkeypatch):
    save(Settings(theme="nord"), path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(settings_mod.os, "replace", fail)
    with pytest.raises(SettingsError, match="could not save settings .* No space left"):
        save(Settings(theme="dracula"), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["settings.toml"]  # no temp file left


def test_save_is_atomic_when_writing_fails(path, monkeypatch):
    save(Settings(theme="nord"), path)
    before = path.read_bytes()

    def fail(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(settings_mod.os, "fsync", fail)
    with pytest.raises(SettingsError, match="Input/output error"):
        save(Settings(theme="dracula"), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["settings.toml"]


def test_save_writes_through_a_symlink(tmp_path):
    real = tmp_path / "dotfiles" / "chatapp.toml"
    real.parent.mkdir()
    real.write_text('theme = "nord"\n')
    link = tmp_path / "settings.toml"
    link.symlink_to(real)
    save(Settings(theme="dracula"), link)
    assert link.is_symlink() and load(real).theme == "dracula"


def test_changes_are_validated(path):
    s = Settings()
    with pytest.raises(pydantic.ValidationError):
        s.server.port = -1
    with pytest.raises(pydantic.ValidationError):
        s.keys = {"quit": "ctrl+q", "search": "ctrl+q"}
    s.keys["quit"] = "ctrl q"  # an in-place change skips validation... until saving
    with pytest.raises(SettingsError, match="keys.quit"):
        save(s, path)
    assert not path.exists()
