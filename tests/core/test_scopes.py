"""Which scope (name prefix) each distributed optimizer sharing one compressor gets (core.scopes)."""
import gc

from horovod_topk.core.scopes import ScopeTable, scope_prefix


class Param:
    """A stand-in for a framework parameter: weak-referenceable, compared by identity."""


def test_prefixes():
    assert scope_prefix(0) == "" and scope_prefix(1) == "optimizer1/" and scope_prefix(2) == "optimizer2/"


def test_overlapping_names_get_their_own_scope_and_disjoint_names_share_the_plain_one():
    table, forgotten = ScopeTable(), []
    gen = [("weight", Param()), ("bias", Param())]
    disc = [("weight", Param()), ("bias", Param())]
    head = [("head.weight", Param())]
    assert table.assign(gen, forgotten.append) == ""
    assert table.assign(disc, forgotten.append) == "optimizer1/"
    assert table.assign(head, forgotten.append) == ""  # no overlap: plain names, as with one optimizer
    assert table.assign(disc, forgotten.append) == "optimizer1/"  # the same parameters wrapped again
    assert table.assign(gen[:1], forgotten.append) == ""
    assert len(table) == 2 and forgotten == []


def test_a_scope_whose_parameters_are_gone_is_reused_and_its_state_forgotten():
    table, forgotten = ScopeTable(), []
    keep = [("weight", Param())]
    assert table.assign(keep, forgotten.append) == ""
    old = [("weight", Param()), ("bias", Param())]
    assert table.assign(old, forgotten.append) == "optimizer1/"
    del old
    gc.collect()
    rebuilt = [("weight", Param()), ("extra", Param())]
    assert table.assign(rebuilt, forgotten.append) == "optimizer1/"
    assert sorted(forgotten) == ["optimizer1/bias", "optimizer1/weight"]  # nothing inherited from the dead model


def test_a_name_whose_parameter_is_gone_forgets_only_that_name():
    table, forgotten = ScopeTable(), []
    body, head = Param(), Param()
    assert table.assign([("body", body), ("head", head)], forgotten.append) == ""
    del head
    gc.collect()
    assert table.assign([("body", body), ("head", Param())], forgotten.append) == ""
    assert forgotten == ["head"]
