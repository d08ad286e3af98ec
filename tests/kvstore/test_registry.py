"""The store registry (kvstore/registry.py) is the one table of store URL schemes: the store factory, the
connector factory, --kv-transfer-config and the node CLI read it, and their texts list what it holds."""
from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pdserve.connectors.factory import create_connector
from pdserve.deploy.processes import REPO
from pdserve.kvstore import SCHEMES, open_store, registry
from pdserve.kvstore.base import KVStore
from pdserve.kvstore.registry import ServedBy
from pdserve.serving.kv_transfer_flag import check_connector_store


def test_each_scheme_has_one_entry_and_each_store_entry_a_store_class():
    assert len(registry.BY_SCHEME) == sum(len(e.schemes) for e in registry.ENTRIES)
    for entry in registry.entries(ServedBy.STORE):
        assert issubclass(entry.store_class(), KVStore), entry
    for entry in registry.entries(ServedBy.LMCACHE):
        assert entry.store is None and entry.options == {}, entry  # LMCache reads its URL itself
    assert SCHEMES == ("file", "redis", "rediss", "redis+cluster", "rediss+cluster")


def test_lmcache_owns_lm_and_its_default_address():
    entry = registry.lookup("LM://10.0.0.5:1234")
    assert entry is not None and entry.served_by is ServedBy.LMCACHE
    assert entry.address("lm://10.0.0.5:1234") == ("10.0.0.5", 1234)
    assert entry.address("lm://") == ("127.0.0.1", 65432)
    assert registry.lookup("s3://bucket") is None and registry.lookup("redis://[::1/0") is None


def test_the_texts_that_list_urls_are_generated_from_the_registry():
    store_forms = "file:///path, redis[s]://host:port/db or redis[s]+cluster://host:port[,host:port...]/"
    assert registry.url_forms(registry.store_entries()) == store_forms
    with pytest.raises(ValueError, match=re.escape(f"unsupported KV store URL 'lm://h:1': use {store_forms}")):
        open_store("lm://h:1")  # LMCache's: pdserve has no store class for it
    config = SimpleNamespace(kv_transfer=SimpleNamespace(enabled=True, kv_store="s3://bucket", lmcache_config=None))
    with pytest.raises(ValueError, match=re.escape(f"use {store_forms.replace(' or ', ', ')} or lm://host:port")):
        create_connector(config, None)  # type: ignore[arg-type]
    config.kv_transfer.kv_store, config.kv_transfer.lmcache_config = "file:///tmp/kv", "lmcache.yaml"
    with pytest.raises(ValueError, match=re.escape("lmcache_config applies to LMCache stores (lm://host:port)")):
        create_connector(config, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("takes a file://, redis:// or redis+cluster:// store (lm:// is "
                                                   "LMCacheConnectorV1's)")):
        check_connector_store("StoreConnector", "lm://h:1", None)


def test_every_scheme_is_in_the_configuration_docs():
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text[text.index("## KV store URLs"):text.index("\n## ", text.index("## KV store URLs") + 1)]
    missing = [s for s in registry.schemes() if f"`{s}://" not in section]
    assert not missing, f"docs/configuration.md's KV store URLs table lacks {missing}"


def test_reading_the_registry_loads_no_torch():
    code = "import sys, pdserve.kvstore.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out
