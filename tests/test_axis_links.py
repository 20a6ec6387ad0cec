"""Which mesh axes cross nodes: derived from devices_per_node and the axes' sizes and order, priced at the
right link, recorded in the plan and shown by print(plan) (issue 52.5)."""
from dataclasses import replace

import torch

import autopar
import cost_models as cm
from autopar.testing import MLP

H100 = cm.PRESETS["h100"]


def test_tp_of_8_last_is_inside_a_node_and_dp_of_64_across():
    axes = [("dp", 64), ("tp", 8)]
    assert cm.axis_reach(axes, 8) == {"dp": "across", "tp": "inside"}
    links = cm.axis_links(axes, H100)
    assert links == {"dp": H100.inter_node_link, "tp": H100.intra_node_link}
    d = cm.describe_links(axes, H100, links)
    assert d["tp"] == {"reach": "inside", "bandwidth": 370.8e9, "latency": 3e-6, "given": False}
    assert d["dp"]["reach"] == "across" and d["dp"]["bandwidth"] == 50e9 and not d["dp"]["given"]


def test_an_axis_of_16_on_8_a_node_spans_nodes_at_the_slower_link():
    axes = [("dp", 2), ("tp", 16)]
    # tp's ring runs 7 steps inside a node and 1 across: partly across, and priced at the inter-node link
    assert cm.axis_reach(axes, 8) == {"dp": "across", "tp": "spans"}
    assert cm.axis_links(axes, H100)["tp"] == H100.inter_node_link
    # an outer axis that reaches past a node while the inner ones fill less than one spans too
    assert cm.axis_reach([("pp", 4), ("dp", 2), ("tp", 2)], 8) == {"pp": "spans", "dp": "inside", "tp": "inside"}
    # and one whose inner axes fill whole nodes is across
    assert cm.axis_reach([("pp", 4), ("dp", 4), ("tp", 2)], 8)["pp"] == "across"


def test_a_given_link_is_marked_given():
    axes = [("dp", 4), ("tp", 2)]
    slow = cm.Link(1e9, 5e-4)
    d = cm.describe_links(axes, H100, cm.axis_links(axes, H100, {"tp": slow}))
    assert d["tp"]["given"] and d["tp"]["bandwidth"] == 1e9 and d["tp"]["reach"] == "inside"
    assert not d["dp"]["given"]


def _plan(**options):
    torch.manual_seed(0)
    # 2 devices a node, so a 2 x 2 mesh has one axis inside a node and one across
    hw = replace(H100, name="h100-2-a-node", devices_per_node=2)
    return autopar.plan(MLP([8, 16, 8]), (torch.randn(8, 8),), {"dp": 2, "tp": 2}, hardware=hw, **options)


def test_print_plan_names_each_axis_link_and_json_keeps_it():
    plan = _plan(strategy="fsdp+tp")
    assert plan.links["tp"]["reach"] == "inside" and plan.links["dp"]["reach"] == "across"
    assert "links: tp inside a node (371 GB/s), dp across nodes (50 GB/s)" in str(plan)
    back = autopar.Plan.from_json(plan.to_json())
    assert back.links == plan.links and back == plan
    assert "links: tp inside a node (371 GB/s), dp across nodes (50 GB/s)" in str(back)


def test_print_plan_says_when_a_link_was_given():
    plan = _plan(strategy="fsdp+tp", links={"dp": cm.Link(1e9, 5e-4)})
    assert "links: tp inside a node (371 GB/s), dp at the link given for it (1 GB/s)" in str(plan)


def test_axes_sharing_a_link_are_named_together():
    torch.manual_seed(0)
    plan = autopar.plan(MLP([8, 16, 8]), (torch.randn(8, 8),), {"pp": 2, "dp": 2, "tp": 2}, hardware="h100",
                        strategy="fsdp")
    assert "links: tp, dp and pp inside a node (371 GB/s)" in str(plan)
