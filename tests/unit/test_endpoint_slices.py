"""What one EndpointSlice object says about its Service's pods (gateway_plugin.kubernetes_pods.slice_endpoints, pure):
the Service from its label, one endpoint a pod at the slice's http port (8080 when it lists none), IPv6 in
brackets, ``ready`` unset counting as ready, ``terminating`` as said."""

from __future__ import annotations

from gateway_plugin.kubernetes_pods import Endpoint, slice_endpoints


def test_a_slice_lists_its_service_and_one_endpoint_a_pod() -> None:
    obj = {
        "addressType": "IPv4",
        "metadata": {"name": "m-stage-0-x7k2p", "labels": {"kubernetes.io/service-name": "m-stage-0"}},
        "ports": [{"name": "metrics", "port": 8081, "protocol": "TCP"}, {"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": ["10.1.0.7"], "targetRef": {"kind": "Pod", "name": "m-stage-0-5d9f-a"},
             "conditions": {"ready": True, "serving": True, "terminating": False}},
            {"addresses": ["10.1.0.8"], "targetRef": {"kind": "Pod", "name": "m-stage-0-5d9f-b"}, "conditions": {}},
            {"addresses": ["10.1.0.9"], "targetRef": {"kind": "Pod", "name": "m-stage-0-5d9f-c"},
             "conditions": {"ready": False, "serving": True, "terminating": True}},
            {"addresses": ["10.1.0.10"], "conditions": {"ready": False}},
            {"addresses": []},  # no address: nothing to call
        ],
    }
    assert slice_endpoints(obj) == ("m-stage-0", [
        Endpoint("m-stage-0-5d9f-a@10.1.0.7:8080", "http://10.1.0.7:8080/", ready=True, terminating=False),
        Endpoint("m-stage-0-5d9f-b@10.1.0.8:8080", "http://10.1.0.8:8080/", ready=True, terminating=False),
        Endpoint("m-stage-0-5d9f-c@10.1.0.9:8080", "http://10.1.0.9:8080/", ready=False, terminating=True),
        Endpoint("10.1.0.10:8080", "http://10.1.0.10:8080/", ready=False, terminating=False),
    ])


def test_ipv6_no_ports_and_no_label() -> None:
    obj = {"addressType": "IPv6", "metadata": {"name": "s"}, "ports": None,
           "endpoints": [{"addresses": ["fd00::5"], "targetRef": {"name": "p"}, "conditions": {"ready": True}}]}
    assert slice_endpoints(obj) == (None, [Endpoint("p@[fd00::5]:8080", "http://[fd00::5]:8080/", True, False)])
    udp_only = {**obj, "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}, {"port": 9000}]}
    assert slice_endpoints(udp_only)[1][0].url == "http://[fd00::5]:9000/"  # TCP is the default protocol
