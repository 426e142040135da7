"""nf_tables change events: what someone committed, and whether it was us.

The kernel announces every committed nftables change of a network namespace on the
netlink multicast group ``NFNLGRP_NFTABLES``: one message per object added or deleted
(table, chain, rule, set, element, ...), then a ``NEWGEN`` message closing the commit,
carrying the new generation id, the committing thread's id and its name. Every message's
header carries the *port id* of the netlink socket that committed. This module reads
those messages (:class:`EventSocket`), groups them into commits (:class:`CommitAssembler`),
tells our own commits from everyone else's (:class:`OwnWriters`) and, in
:class:`NftablesEventWatcher`, reports the foreign commits an :class:`Interest` cares about
to the self-healing core (:mod:`kubeproxy.selfheal`).

What was measured on this project's machine (kernel 6.18), and why the code looks so:

* ``NEWGEN``'s pid is the id of the committing *thread* (a commit from the sync thread
  reported that thread's id, not ``os.getpid()``) in the *initial* pid namespace (``nft``
  run inside ``unshare --pid`` reported its host pid, 15113, while it was pid 4 inside).
  A proxy in a container without ``hostPID`` cannot compare it with anything of its own.
  The header's port id can: it names the socket, and a new process's first netlink socket
  gets its pid *in the process's own pid namespace* (4 in that test). So our commits are
  recognised by port id: the sockets this process holds (libnftables' own, found through
  ``/proc/self/fd``) and the processes it spawned (iptables-restore), with the ``NEWGEN``
  pid as a second key where it is meaningful.
* Loading 100k map elements produced 100,004 messages in 2,566 datagrams (9.6 MB);
  deleting the table afterwards produced 7 (the table, its chains and sets: no message per
  element), flushing a 10k-element set 10,000. Decoding the 100k messages with pyroute2's
  nfnetlink classes took 2.34 s (23.4 us a message), with :func:`parse_datagram` 0.087 s
  (0.87 us): the listener shares the interpreter with the sync it watches, so the
  messages are read by hand (header and the first attributes only).
* Our own syncs are the largest source of messages (a cold sync at 10k Services sends
  over 100k). A classic BPF filter on the socket drops every message from our own
  sockets in the kernel (:meth:`EventSocket.ignore_portids`), so they cost nothing here
  and cannot overflow the socket buffer.
* Expiring set elements (timeouts) and the packet path's ``update @map`` send nothing.

When messages are lost anyway (``ENOBUFS``: the buffer overflowed), the watcher cannot
know what it missed and reports it as a change of kind ``missed-events`` (one full sync).
When the socket cannot be had at all, it falls back to comparing the ruleset generation
every few seconds (:data:`FALLBACK_INTERVAL`) and says so once in the log.

One module per concept: :mod:`~kubeproxy.nftevents.messages` (the wire),
:mod:`~kubeproxy.nftevents.commits` (grouping and summaries),
:mod:`~kubeproxy.nftevents.ownership` (who we are; the children of our executors are
tracked in :mod:`kubeproxy.host.children`), :mod:`~kubeproxy.nftevents.eventsocket` (the socket
and its kernel filter) and :mod:`~kubeproxy.nftevents.watcher`. Every public name is
importable from here.
"""

from kubeproxy.nftevents.commits import Commit, CommitAssembler, Interest, ObjectKey, summarize
from kubeproxy.nftevents.eventsocket import (
    NFNLGRP_NFTABLES,
    EventsLost,
    EventSocket,
    read_generation,
)
from kubeproxy.nftevents.messages import NETLINK_NETFILTER, Generation, ObjectChange, parse_datagram
from kubeproxy.nftevents.ownership import OwnWriters, own_netlink_portids
from kubeproxy.nftevents.watcher import FALLBACK_INTERVAL, NftablesEventWatcher

__all__ = [
    "FALLBACK_INTERVAL",
    "NETLINK_NETFILTER",
    "NFNLGRP_NFTABLES",
    "Commit",
    "CommitAssembler",
    "EventSocket",
    "EventsLost",
    "Generation",
    "Interest",
    "NftablesEventWatcher",
    "ObjectChange",
    "ObjectKey",
    "OwnWriters",
    "own_netlink_portids",
    "parse_datagram",
    "read_generation",
    "summarize",
]
