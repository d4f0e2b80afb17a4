"""Which scope (name prefix) each distributed optimizer sharing one compressor gets (core.scopes)."""
import gc

from horovod_topk.core.scopes import ScopeTable, scope_prefix


class Param:
    """A stand-in for a framework parameter: weak-referenceable, compared by identity."""


def test_prefixes():
    assert scope_prefix(0) == "" and scope_prefix(1) == "optimizer1/" and scope_prefix(2) == "optimizer2/"


def test_overlapping_names_get_their_own_scope_and_disjoint_names_share_the_plain_one():
    table = ScopeTable()
    gen = [("weight", Param()), ("bias", Param())]
    disc = [("weight", Param()), ("bias", Param())]
    head = [("head.weight", Param())]
    assert table.assign(gen) == ""
    assert table.assign(disc) == "optimizer1/"
    assert table.assign(head) == ""  # no overlap: plain names, as with one optimizer
    assert table.assign(disc) == "optimizer1/"  # the same parameters wrapped again
    assert table.assign(gen[:1]) == ""
    assert len(table) == 2


def test_a_claim_outlives_its_parameter_so_every_rank_picks_the_same_prefix():
    """Garbage collection runs at different times on different ranks: scopes must not depend on it."""
    table = ScopeTable()
    assert table.assign([("weight", Param())]) == ""  # the parameter dies at once
    gc.collect()
    assert table.assign([("weight", Param())]) == "optimizer1/"
