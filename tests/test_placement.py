"""cluster.component_placement, parsed as the public reference documents it."""

import pytest

from embodied.placement import Device, PlacementError, parse_ranks, plan_placement


@pytest.mark.parametrize(
    "spec, total, ranks",
    [
        ("all", 4, (0, 1, 2, 3)),
        (3, 4, (3,)),
        ("3", 4, (3,)),
        ("0,2,3", 4, (0, 2, 3)),
        ("0-3", 8, (0, 1, 2, 3)),
        ("0-3,5,14", 16, (0, 1, 2, 3, 5, 14)),
        (" 1 - 2 , 4", 8, (1, 2, 4)),
    ],
)
def test_reference_examples(spec, total, ranks):
    assert parse_ranks(spec, total, "actor") == ranks


def test_ranks_across_nodes_map_to_node_and_local_device():
    plan = plan_placement({"actor": "0-3,5,14"}, num_nodes=2, devices_per_node=8, accelerator="gpu")
    assert plan.devices("actor") == (
        Device(0, 0), Device(0, 1), Device(0, 2), Device(0, 3), Device(0, 5), Device(1, 6))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("3-1", "must run upwards"),
        ("a", "is not a device rank"),
        ("0-2,1", "named more than once"),
        ("0,0", "named more than once"),
        ("4", "does not exist; the cluster has 4 device(s)"),
        ("-1", "is not a device rank"),
        ("", "is not a device rank"),
    ],
)
def test_malformed_specs_are_rejected_with_the_key(spec, message):
    with pytest.raises(PlacementError) as err:
        parse_ranks(spec, 4, "rollout")
    assert message in str(err.value)
    assert "cluster.component_placement.rollout" in str(err.value)


def test_several_components_on_one_line_share_devices_collocated():
    plan = plan_placement({"actor,env,rollout": "all"}, 1, 2, "cpu")
    assert plan.mode == "collocated"
    assert plan.devices("env") == plan.devices("actor") == (Device(0, 0), Device(0, 1))
    assert plan.ranks["rollout"] == 2


def test_mode_is_derived_from_overlaps():
    disaggregated = plan_placement({"env": "0-1", "rollout": "2-3", "actor": "4-7"}, 1, 8, "gpu")
    hybrid = plan_placement({"env,rollout": "0-3", "actor": "0-7"}, 1, 8, "gpu")
    assert disaggregated.mode == "disaggregated"
    assert hybrid.mode == "hybrid"


def test_component_placed_twice_is_an_error():
    with pytest.raises(PlacementError, match="'env' is placed twice"):
        plan_placement({"actor,env": "0", "env,rollout": "1"}, 1, 2, "cpu")


def test_unplaced_component_lookup_names_the_placed_ones():
    plan = plan_placement({"actor": "0"}, 1, 2, "cpu")
    with pytest.raises(PlacementError, match="no entry for 'env'"):
        plan.devices("env")
