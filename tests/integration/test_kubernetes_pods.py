"""The plugin's pod directory (gateway_plugin.kubernetes_pods) against a fake EndpointSlice API on loopback
(tests/support/fake_endpointslices.py): list (paged) then watch, endpoint conditions to pod states, a watch whose
version expired (410) re-lists, the service account's token re-read and its CA verifying https, and the setting
that turns it on."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from gateway_plugin import kubernetes_pods
from gateway_plugin.config import PluginConfig
from gateway_plugin.kubernetes_pods import KubernetesAPI, PodDirectory, pod_directory
from support.fake_endpointslices import FakeEndpointSlices, endpoint_slice, self_signed_server

NS, FN = "openfaas-fn", "t-stage-0"


async def until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the directory did not catch up"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def directory(tmp_path, token: str = "sa-token"):
    (tmp_path / "token").write_text(token)
    fake = await FakeEndpointSlices("sa-token").start()
    pods = PodDirectory(KubernetesAPI(fake.url, str(tmp_path)))
    try:
        yield fake, pods
    finally:
        await pods.close()
        await fake.stop()


def ids(pods: PodDirectory, function: str = FN) -> list[str]:
    return sorted(p.id for p in pods.ready(function))


def test_pods_are_listed_paged_then_watched_and_follow_their_conditions(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kubernetes_pods, "PAGE", 1)  # one slice a page: the list follows `continue`

    async def main():
        async with directory(tmp_path) as (fake, pods):
            await fake.put(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", True), ("pod-b", "10.0.0.2", True)]))
            await fake.put(NS, endpoint_slice("t-b", FN, [("pod-c", "10.0.0.3", True)], port=9090))
            await fake.put(NS, endpoint_slice("o-a", "other", [("pod-o", "10.0.0.9", True)]))
            await fake.put("elsewhere", endpoint_slice("t-x", FN, [("pod-x", "10.9.0.1", True)]))
            await pods.follow({FN: NS})  # the first list is in when it returns
            assert fake.lists == 3  # three pages
            assert ids(pods) == ["pod-a@10.0.0.1:8080", "pod-b@10.0.0.2:8080", "pod-c@10.0.0.3:9090"]
            assert {p.url for p in pods.ready(FN)} == {"http://10.0.0.1:8080/", "http://10.0.0.2:8080/",
                                                       "http://10.0.0.3:9090/"}
            assert pods.ready("other") == []  # not followed
            a = next(p for p in pods.ready(FN) if p.id.startswith("pod-a"))
            # watched: pod-b fails its readiness probe, pod-a terminates (its sessions move off), pod-d starts
            await fake.put(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", False), ("pod-b", "10.0.0.2", False),
                                                          ("pod-d", "10.0.0.4", True)], terminating=frozenset({"pod-a"})))
            await until(lambda: ids(pods) == ["pod-c@10.0.0.3:9090", "pod-d@10.0.0.4:8080"])
            assert a.state == "draining" and pods.pods[FN]["pod-b@10.0.0.2:8080"].state == "unready"
            await fake.delete(NS, "t-a")  # gone from every slice: draining, out of the directory
            await until(lambda: ids(pods) == ["pod-c@10.0.0.3:9090"])
            assert a.state == "draining" and set(pods.pods[FN]) == {"pod-c@10.0.0.3:9090"}
            assert fake.lists == 3 and pods.relists == 0  # all of it through the one watch
    asyncio.run(main())


def test_an_expired_watch_lists_again(tmp_path) -> None:
    async def main():
        async with directory(tmp_path) as (fake, pods):
            await fake.put(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", True)]))
            await pods.follow({FN: NS})
            await until(lambda: fake.watches == 1)
            # the watch ends before it sees pod-b's arrival, and the history is compacted past its version
            await fake.change_unseen(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", True),
                                                                    ("pod-b", "10.0.0.2", True)]))
            await until(lambda: ids(pods) == ["pod-a@10.0.0.1:8080", "pod-b@10.0.0.2:8080"])
            assert pods.relists == 1 and fake.lists == 2 and fake.watches >= 3  # resumed, 410, listed, watched
            await fake.put(NS, endpoint_slice("t-a", FN, [("pod-b", "10.0.0.2", True)]))  # and watched again
            await until(lambda: ids(pods) == ["pod-b@10.0.0.2:8080"])
    asyncio.run(main())


def test_the_token_is_read_at_every_call_and_a_refusal_is_retried(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(kubernetes_pods, "SYNC_WAIT_S", 0.5)

    async def main():
        async with directory(tmp_path, token="stale") as (fake, pods):
            await fake.put(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", True)]))
            started = time.monotonic()
            await pods.follow({FN: NS})  # refused: no pods; the wait for the first list is bounded
            assert pods.ready(FN) == [] and fake.refused >= 1
            assert time.monotonic() - started <= kubernetes_pods.SYNC_WAIT_S + 1
            (tmp_path / "token").write_text("sa-token")  # the kubelet rotated it
            await until(lambda: ids(pods) == ["pod-a@10.0.0.1:8080"])
    asyncio.run(main())


def test_an_unreachable_pod_takes_no_calls_until_its_slices_change(tmp_path) -> None:
    async def main():
        async with directory(tmp_path) as (fake, pods):
            await fake.put(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", True), ("pod-b", "10.0.0.2", True)]))
            await pods.follow({FN: NS})
            a = pods.pods[FN]["pod-a@10.0.0.1:8080"]
            pods.mark_unreachable(FN, a)
            assert ids(pods) == ["pod-b@10.0.0.2:8080"] and a.state == "dead"
            await pods.follow({FN: NS})  # the gateway's functions polled again: nothing changed for the pod
            assert ids(pods) == ["pod-b@10.0.0.2:8080"]
            await fake.put(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", True), ("pod-b", "10.0.0.2", True),
                                                          ("pod-c", "10.0.0.3", True)]))
            await until(lambda: len(ids(pods)) == 3)  # listed ready again: tried again
            await pods.follow({})  # the function is gone from the gateway: its pods leave
            assert pods.ready(FN) == [] and a.state == "draining"
    asyncio.run(main())


def test_https_is_verified_with_the_service_accounts_ca(tmp_path, monkeypatch) -> None:
    pytest.importorskip("cryptography")
    monkeypatch.setattr(kubernetes_pods, "SYNC_WAIT_S", 0.5)
    server, client, stranger = (tmp_path / n for n in ("server", "sa", "other"))
    for folder in (server, client, stranger):
        folder.mkdir()
    ca, tls = self_signed_server(server)
    self_signed_server(stranger)  # another cluster's CA

    async def main():
        fake = await FakeEndpointSlices("sa-token").start(tls)
        await fake.put(NS, endpoint_slice("t-a", FN, [("pod-a", "10.0.0.1", True)]))
        (client / "token").write_text("sa-token")
        (client / "ca.crt").write_bytes(ca.read_bytes())
        (stranger / "token").write_text("sa-token")
        trusting, wary = (PodDirectory(KubernetesAPI(fake.url, str(d))) for d in (client, stranger))
        try:
            assert fake.url.startswith("https://")
            await trusting.follow({FN: NS})
            assert ids(trusting) == ["pod-a@10.0.0.1:8080"]
            lists = fake.lists
            await wary.follow({FN: NS})  # its CA did not sign the server's certificate: no TLS, no list
            assert ids(wary) == [] and fake.lists == lists
        finally:
            for pods in (trusting, wary):
                await pods.close()
            await fake.stop()
    asyncio.run(main())


def test_the_platform_setting_turns_pod_addressing_on() -> None:
    assert pod_directory(PluginConfig()) is None  # default: function-level dispatch through the gateway
    config = PluginConfig.from_env({"QUART_PLATFORM": "kubernetes", "QUART_KUBERNETES_API_URL": "https://k8s:6443",
                                    "QUART_KUBERNETES_CREDENTIALS_DIR": "/sa"})
    pods = pod_directory(config)
    assert isinstance(pods, PodDirectory) and pods.api.url == "https://k8s:6443"
    assert pods.api.credentials_dir == "/sa"
    with pytest.raises(ValueError, match="QUART_PLATFORM must be one of openfaas, kubernetes, got 'nomad'"):
        pod_directory(PluginConfig(platform="nomad"))
    assert PluginConfig().kubernetes_credentials_dir == "/var/run/secrets/kubernetes.io/serviceaccount"
