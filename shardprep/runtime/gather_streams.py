"""The gatherer's CUDA streams and events: made once per gatherer, never replaced, external events kept alive.

A CUDA graph captured over a LayerGatherer holds record and wait nodes on its two external events (`handoff`,
`draft_gathered`). A graph node on a destroyed event is undefined behaviour: on an H100 (torch 2.11, CUDA 13) the
next `CUDAGraph.replay()` died of SIGSEGV inside `cudaGraphLaunch`, or hung, after a test replaced the gatherer's
`handoff` event, which destroyed the one its captured target graph recorded. So:

- the record is frozen: an assignment to one of its fields raises where it is written, not at a later replay;
- the external events are also held by this module for the life of the process, because a graph can outlive every
  Python reference to them (a gatherer rebuilt, an attribute replaced) and the gatherer cannot see its graphs.
  Two events per gatherer; a server builds one gatherer (two with a draft) per process.

The other events are recorded and waited on inside one capture only (a fork and its join), where they become graph
edges, not nodes, or eagerly; nothing of them outlives the call that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_KEPT_FOR_GRAPHS: list[torch.cuda.Event] = []  # every external event ever made here (see the module docstring)


@dataclass(frozen=True)
class GatherStreams:
    """The streams a gatherer issues on and the events that order them (the gatherer's docstring says when each
    is recorded and what each wait protects).

    >>> streams = GatherStreams.on(torch.device("cuda", 0))  # doctest: +SKIP
    >>> streams.gather.wait_event(streams.forked)  # doctest: +SKIP
    """

    gather: torch.cuda.Stream  # every gather of a forward except a prefetched first one, and the tag ops
    first: torch.cuda.Stream  # prefetch_first()'s gather, issued before begin() (e.g. while sampling)
    draft: torch.cuda.Stream  # prefetch_draft()'s gather of the draft's first layer, off the target's CUDA graph
    forked: torch.cuda.Event  # on the compute stream when a slot has no trustworthy done event: all work so far
    counted: torch.cuda.Event  # on the gather stream after a forward's tag count was bumped (and the last check)
    first_gathered: torch.cuda.Event  # on the first stream after a prefetched first gather
    checked: torch.cuda.Event  # on the gather stream after the tag check (joins it back into a captured graph)
    # External (a record / wait node when captured), so eager work and separate graphs can use them:
    handoff: torch.cuda.Event  # compute stream, wait(D−1) of a detached forward: G(D)'s slot is free, G(D−1) in
    draft_gathered: torch.cuda.Event  # after every G(D) issued outside a capture (prefetch, inline or eager)

    @classmethod
    def on(cls, device: torch.device) -> GatherStreams:
        """New streams and events on `device`, the external events recorded once (a wait inside a capture on an
        event never recorded would capture no node at all) and kept for the life of the process."""
        streams = cls(gather=torch.cuda.Stream(device), first=torch.cuda.Stream(device),
                      draft=torch.cuda.Stream(device), forked=torch.cuda.Event(), counted=torch.cuda.Event(),
                      first_gathered=torch.cuda.Event(), checked=torch.cuda.Event(),
                      handoff=torch.cuda.Event(external=True), draft_gathered=torch.cuda.Event(external=True))
        _KEPT_FOR_GRAPHS.extend((streams.handoff, streams.draft_gathered))
        streams.handoff.record(torch.cuda.current_stream(device))
        streams.draft_gathered.record(streams.draft)
        return streams
