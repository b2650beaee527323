"""`rollout.stale_groups`: "train" by default (a completed group is never dropped for its age), "drop" as an
option, anything else refused at load naming the value."""

from __future__ import annotations

import pytest

from megatron_tail.config import ConfigError, load_config


def test_stale_groups_defaults_to_train_and_accepts_drop():
    assert load_config(None, []).rollout.stale_groups == "train"
    assert load_config(None, ["rollout.stale_groups=drop"]).rollout.stale_groups == "drop"


def test_an_unknown_stale_groups_is_refused():
    with pytest.raises(ConfigError, match=r'rollout\.stale_groups must be "train" or "drop"; got \'keep\''):
        load_config(None, ["rollout.stale_groups=keep"])
