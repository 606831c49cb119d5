"""hivemind's DHT documentation examples, run unchanged on swarmavg.

Each test runs one example as hivemind gives it (learning-at-home/hivemind at commit 4bd43b77:
``docs/user/dht.md``, ``docs/user/quickstart.md``, the docstrings of ``hivemind.DHT`` and
``DHTNode``, and ``tests/test_dht.py``, hivemind's own usage of them), between ``# -- hivemind``
and ``# -- end`` comments. Only the import lines differ (``from swarmavg import ...``,
``import swarmavg as hivemind``). Then the test checks what the docs say the example does.
Peers listen on 127.0.0.1 over TCP (hivemind's default too).

Changed or left out, on purpose:

* "Running across the Internet" listens on 0.0.0.0 (tests stay on loopback: it runs with
  127.0.0.1) and calls ``hivemind.utils.networking.choose_ip_address`` (swarmavg has no
  ``utils``: that line is left out); its second block dials example peers that do not exist.
* ``use_ipfs=True``: swarmavg has no IPFS bootstrap.
* ``test_run_coroutine``: hivemind runs the coroutine in the DHT's process on a copy of the DHT
  object, and asserts ``not hasattr(dht, "_x_dummy")``; swarmavg runs it in the caller's process
  on the object itself, where what it sets stays. The parts that assert what runs within a
  0.25 s timer are left out.
* ``test_get_store`` runs on three peers instead of ``launch_dht_instances(10)``.
"""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest

import swarmavg.dht
import swarmavg.sync
from swarmavg import DHT, ValueWithExpiration, get_dht_time
from swarmavg.aio.dht import DHTNode

pytestmark = pytest.mark.timeout(60)

#: Seconds one blocking wait of a test (not of an example) may take.
WAIT = 10


@pytest.fixture(autouse=True)
def _shut_down_what_the_examples_started() -> Iterator[None]:
    """The examples never shut their DHTs down (hivemind's DHT processes die with their
    parent): shut down every DHT a test started and left running."""
    yield
    swarmavg.sync._loop._shut_facades_down()  # (what interpreter exit does)


def _close_to(expiration: float, seconds_from_now: float) -> bool:
    return get_dht_time() + seconds_from_now - 30 < expiration <= get_dht_time() + seconds_from_now


def test_dht_md_first_and_second_node_store_and_get_a_tuple(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # fmt: off
    # -- hivemind docs/user/dht.md: "To initialize the first DHT node, run"
    from swarmavg import DHT, get_dht_time

    dht = DHT(start=True)
    # create the first DHT node that listens for incoming connections from localhost only

    print("For incoming connections, use:", dht.get_visible_maddrs())
    # -- end
    # fmt: on
    # fmt: off
    # -- hivemind docs/user/dht.md: "You can now start more peers that connect to an existing
    #    DHT node using its listen address"
    dht2 = DHT(initial_peers=dht.get_visible_maddrs(), start=True)
    # -- end
    # fmt: on
    # fmt: off
    # -- hivemind docs/user/dht.md, "Store/get operations"
    # first node: store a key-value pair for 600 seconds
    store_ok = dht.store('my_key', ('i', 'love', 'bees'),
                         expiration_time=get_dht_time() + 600)

    # second node: get the value stored by the first node
    value, expiration = dht2.get('my_key', latest=True)
    assert value == ('i', 'love', 'bees')
    # -- end
    # fmt: on

    printed = capsys.readouterr().out
    maddrs = dht.get_visible_maddrs()
    assert printed == f"For incoming connections, use: {maddrs}\n"
    assert maddrs
    assert all(m.startswith("/ip4/127.0.0.1/tcp/") for m in maddrs)  # localhost only
    assert store_ok is True
    assert type(value) is tuple  # (not a list: hivemind keeps tuples, and so do we)
    assert _close_to(expiration, 600)
    # "the new node will share the key-value data with the first node"
    assert dht.get("my_key") == (value, expiration)


def test_dht_md_values_with_subkeys_party(capsys: pytest.CaptureFixture[str]) -> None:
    dht = DHT(start=True)
    dht2 = DHT(initial_peers=dht.get_visible_maddrs(), start=True)
    # fmt: off
    # -- hivemind docs/user/dht.md, "Values with subkeys"
    alice_dht = DHT(initial_peers=dht.get_visible_maddrs(), start=True)
    bob_dht = DHT(initial_peers=dht2.get_visible_maddrs(), start=True)
    carol_dht = DHT(initial_peers=alice_dht.get_visible_maddrs(), start=True)


    # first, each peer stores a subkey for the same key
    alice_dht.store('party', subkey='alice', value='yes', expiration_time=get_dht_time() + 600)
    bob_dht.store('party', subkey='bob', value='yes', expiration_time=get_dht_time() + 600)
    carol_dht.store('party', subkey='carol', value='no', expiration_time=get_dht_time() + 600)

    # then, any peer can get the full list of attendees
    attendees, expiration = alice_dht.get('party', latest=True)
    print(attendees)
    # {'alice': ValueWithExpiration(value='yes', expiration_time=1625504352.2668974),
    #  'bob': ValueWithExpiration(value='yes', expiration_time=1625504352.2884178),
    #  'carol': ValueWithExpiration(value='no', expiration_time=1625504352.3046832)}
    # -- end
    # fmt: on

    assert {name: vote for name, (vote, _) in attendees.items()} == {
        "alice": "yes",
        "bob": "yes",
        "carol": "no",
    }
    assert all(isinstance(item, ValueWithExpiration) for item in attendees.values())
    assert all(_close_to(item.expiration_time, 600) for item in attendees.values())
    # the dictionary's expiration: the latest of its subkeys' (carol stored last)
    assert expiration == max(item.expiration_time for item in attendees.values())
    assert expiration == attendees["carol"].expiration_time
    # printed as the docs show it
    number = r"\d+\.\d+"
    shown = ", ".join(
        rf"'{name}': ValueWithExpiration\(value='{vote}', expiration_time={number}\)"
        for name, vote in (("alice", "yes"), ("bob", "yes"), ("carol", "no"))
    )
    assert re.fullmatch(rf"\{{{shown}\}}\n", capsys.readouterr().out)
    # every peer reads the same dictionary
    for peer in (dht, dht2, bob_dht, carol_dht):
        assert peer.get("party", latest=True) == (attendees, expiration)


def test_dht_md_return_future_gives_a_future_that_asyncio_can_await() -> None:
    # "you can call these requests asynchronously via dht.store/get/run_coroutine(...,
    # return_future=True). This will run the corresponding command in background and return
    # a Future-like object that can be awaited. [...] the returned future is compatible with
    # asyncio (i.e. can be awaited inside the event loop)."
    with DHT(start=True) as dht, DHT(initial_peers=dht.get_visible_maddrs(), start=True) as dht2:
        future = dht.store(
            "my_key", ("i", "love", "bees"), get_dht_time() + 600, return_future=True
        )
        assert future.result(WAIT) is True
        value, expiration = dht2.get("my_key", latest=True, return_future=True).result(WAIT)
        assert value == ("i", "love", "bees")

        async def dummy_dht_coro(self: DHT, node: DHTNode) -> str:
            return "pew"

        async def in_asyncio() -> tuple[Any, ...]:
            return (
                await dht2.get("my_key", return_future=True),
                await dht2.store("other", 1, get_dht_time() + 60, return_future=True),
                await dht2.run_coroutine(dummy_dht_coro, return_future=True),
            )

        got, stored, pew = asyncio.run(asyncio.wait_for(in_asyncio(), WAIT))
        assert got == (("i", "love", "bees"), expiration)
        assert stored is True
        assert pew == "pew"


def test_quickstart_peers_join_by_the_printed_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    # fmt: off
    # -- hivemind docs/user/quickstart.md (first peer)
    import swarmavg as hivemind

    # Create DHT: a decentralized key-value storage shared between peers
    dht = hivemind.DHT(start=True)
    print("To join the training, use initial_peers =", [str(addr) for addr in dht.get_visible_maddrs()])
    # -- end
    # fmt: on
    first = dht
    printed = capsys.readouterr().out
    match = re.fullmatch(r"To join the training, use initial_peers = (\[.*\])\n", printed)
    assert match is not None
    COPY_FROM_OTHER_PEERS_OUTPUTS = ast.literal_eval(match[1])[0]  # (copied by hand)
    # fmt: off
    # -- hivemind docs/user/quickstart.md (second peer)
    # Create DHT: a decentralized key-value storage shared between peers
    dht = hivemind.DHT(initial_peers=[COPY_FROM_OTHER_PEERS_OUTPUTS], start=True)
    print("To join the training, use initial_peers =", [str(addr) for addr in dht.get_visible_maddrs()])
    # -- end
    # fmt: on
    assert capsys.readouterr().out.startswith("To join the training, use initial_peers = ['/ip4/")
    assert dht.store("joined", True, get_dht_time() + 60)
    assert first.get("joined", latest=True).value is True


def test_dht_md_running_across_the_internet_on_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    # fmt: off
    # -- hivemind docs/user/dht.md, "Running across the Internet", with 127.0.0.1 for
    #    0.0.0.0 and without the line that calls hivemind.utils.networking.choose_ip_address
    import swarmavg as hivemind
    dht = hivemind.DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic"],
        start=True)

    print('\n'.join(str(addr) for addr in dht.get_visible_maddrs()))
    # -- end
    # fmt: on
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", lines[0])
    assert re.fullmatch(r"/ip4/127\.0\.0\.1/udp/\d+/quic-v1/p2p/\w+", lines[1])
    # "now the two DHT nodes are connected": over either address
    # (and "set client_mode=True. In this case, the DHT instance will access others, but
    # it will not announce that other peers can connect to it.")
    over_quic = hivemind.DHT(initial_peers=lines[1:], client_mode=True, start=True)
    assert over_quic.get_visible_maddrs() == []
    assert over_quic.store("seen", "over quic", get_dht_time() + 60)
    assert dht.get("seen").value == "over quic"


def test_dht_docstrings_get_and_store_contracts() -> None:
    # DHT.get: ":returns: (value, expiration time); if value was not found, returns None"
    # DHT.store: ":returns: True if store succeeds, False if it fails (due to no response or
    # newer value)"; DHTNode: "DHT nodes always prefer values with higher expiration time"
    with DHT(start=True) as dht, DHT(initial_peers=dht.get_visible_maddrs(), start=True) as dht2:
        assert dht2.get("nobody stored this") is None
        assert dht2.get("nobody stored this", latest=True) is None
        now = get_dht_time()
        assert dht.store("key", "newer", expiration_time=now + 60) is True
        assert dht2.store("key", "older", expiration_time=now + 30) is False
        assert dht2.get("key", latest=True) == ("newer", now + 60)


def test_hivemind_test_get_store() -> None:
    # hivemind tests/test_dht.py::test_get_store, its body unchanged but for the swarm: three
    # swarmavg.DHT peers in place of launch_dht_instances(10) (which forks processes)
    import random

    first = DHT(start=True)
    peers = [first, *(DHT(initial_peers=first.get_visible_maddrs(), start=True) for _ in "ab")]
    # fmt: off
    # -- hivemind tests/test_dht.py::test_get_store
    node1, node2 = random.sample(peers, 2)
    assert node1.store("key1", "value1", expiration_time=get_dht_time() + 30)
    assert node1.get("key1").value == "value1"
    assert node2.get("key1").value == "value1"
    assert node2.get("key2") is None

    future = node1.get("foo", return_future=True)
    assert future.result() is None

    future = node1.get("foo", return_future=True)
    future.cancel()

    assert node2.store("key1", 123, expiration_time=get_dht_time() + 31)
    assert node2.store("key2", 456, expiration_time=get_dht_time() + 32)
    assert node1.get("key1", latest=True).value == 123
    assert node1.get("key2").value == 456

    assert node1.store("key2", subkey="subkey1", value=789, expiration_time=get_dht_time() + 32)
    assert node2.store("key2", subkey="subkey2", value="pew", expiration_time=get_dht_time() + 32)
    found_dict = node1.get("key2", latest=True).value
    assert isinstance(found_dict, dict) and len(found_dict) == 2
    assert found_dict["subkey1"].value == 789 and found_dict["subkey2"].value == "pew"

    for peer in peers:
        peer.shutdown()
    # -- end
    # fmt: on


async def dummy_dht_coro(self, node):  # type: ignore[no-untyped-def]
    return "pew"


async def dummy_dht_coro_error(self, node):  # type: ignore[no-untyped-def]
    raise ValueError("Oops, i did it again...")


async def dummy_dht_coro_stateful(self, node):  # type: ignore[no-untyped-def]
    self._x_dummy = getattr(self, "_x_dummy", 123) + 1
    return self._x_dummy


def test_hivemind_test_run_coroutine() -> None:
    # hivemind tests/test_dht.py::test_run_coroutine (the DHT.run_coroutine docstring: "async
    # function [...] Receives 2 arguments: this DHT daemon and a running DHTNode"), but two
    # lines: hivemind runs the coroutine in the DHT's own process, on a copy of the DHT
    # object, so it asserts `not hasattr(dht, "_x_dummy")`; swarmavg runs it in this process
    # on this object (the state it sets is visible). Left out: dummy_dht_coro_long and the
    # cancel after time.sleep(0.25), which assert on timers (what runs within 0.25 s).
    # fmt: off
    # -- hivemind tests/test_dht.py::test_run_coroutine
    dht = DHT(start=True)
    assert dht.run_coroutine(dummy_dht_coro) == "pew"

    with pytest.raises(ValueError):
        dht.run_coroutine(dummy_dht_coro_error)

    assert dht.run_coroutine(dummy_dht_coro_stateful) == 124
    assert dht.run_coroutine(dummy_dht_coro_stateful) == 125
    assert dht.run_coroutine(dummy_dht_coro_stateful) == 126
    # -- end
    # fmt: on
    assert dht._x_dummy == 126  # type: ignore[attr-defined]  # (hivemind: not hasattr)
    # fmt: off
    # -- hivemind tests/test_dht.py::test_run_coroutine

    dht.shutdown()
    # -- end
    # fmt: on
    assert not dht.is_alive()


def test_dhtnode_get_through_run_coroutine_has_hivemind_shapes() -> None:
    # hivemind's DHTNode.get: ":returns: (value, expiration time); if value was not found,
    # returns None", dictionaries too (hivemind tests/test_dht_node.py: `value, time = await
    # node.get(upper_key)`, then `value[subkey1] == (123, now + 10)`), reached as hivemind
    # users reach the node: dht.run_coroutine(lambda dht, node: ...)
    with DHT(start=True) as dht, DHT(initial_peers=dht.get_visible_maddrs(), start=True) as dht2:
        now = get_dht_time()
        upper_key, subkey1, subkey2 = "ololo", "k1", ("k", 2)

        async def store_and_get(_: DHT, node: DHTNode) -> Any:
            assert await node.store(upper_key, subkey=subkey1, value=123, expiration_time=now + 10)
            assert await node.store(
                upper_key, subkey=subkey2, value=(4, 5), expiration_time=now + 20
            )
            assert await node.get("missing") is None
            return await node.get(upper_key, latest=True)

        value, time = dht.run_coroutine(store_and_get)
        assert value[subkey1] == (123, now + 10)
        assert value[subkey2] == ((4, 5), now + 20)
        assert time == now + 20
        assert dht2.run_coroutine(lambda dht, node: node.get(upper_key)) == (value, time)
        assert swarmavg.sync.in_loop_thread() is False
