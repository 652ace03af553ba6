"""EngineConfig's flat keywords land in its parts; whole parts are taken as given (copied)."""

from __future__ import annotations

import pytest

from engine_sidecar.engine_config import EngineConfig, StoreConfig, flat_options


def test_flat_keywords_land_in_their_parts():
    config = EngineConfig.from_options(model="m", ram_cache_bytes=7, promote_threshold=5, conversation_ttl_s=1.5,
                                       batch_kv_bytes=9, prefetch=False, threads=2)
    assert (config.model, config.threads) == ("m", 2)
    assert (config.store.ram_bytes, config.store.prefetch) == (7, False)
    assert config.reuse.promote_threshold == 5
    assert config.conversations.ttl_s == 1.5
    assert config.batching.kv_bytes == 9
    assert config.store.disk_bytes == EngineConfig().store.disk_bytes  # the rest keep their defaults


def test_every_flat_keyword_reaches_its_field():
    for flat, (part, attr) in flat_options().items():
        config = EngineConfig.from_options(**{flat: "sentinel"})
        assert getattr(getattr(config, part) if part else config, attr) == "sentinel", flat


def test_a_flat_keyword_wins_over_its_part_and_the_part_given_is_not_changed():
    store = StoreConfig(ram_bytes=1, disk=False)
    config = EngineConfig.from_options(store=store, ram_cache_bytes=2)
    assert (config.store.ram_bytes, config.store.disk) == (2, False)
    assert store.ram_bytes == 1


def test_unknown_options_are_refused():
    with pytest.raises(TypeError, match="ram_cache_gb"):
        EngineConfig.from_options(ram_cache_gb=2)


def test_parts_are_not_shared_between_configs():
    a, b = EngineConfig(), EngineConfig()
    a.store.prefetch = False
    assert b.store.prefetch is True
