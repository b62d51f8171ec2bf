package router

import (
	"context"
	"fmt"
	"net/netip"
	"strings"

	"github.com/weft-net/weft/internal/ipammesh"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
)

// IPAMChannel is the mesh channel the allocators talk on.
const IPAMChannel = ipammesh.Channel

// openIPAM loads the allocator with the first-claim mode of --ipalloc-init.
// consensus without =N expects the peers of --peers (other than this node)
// plus this one; with no --peers that is a lone peer, which claims at once.
func (r *Router) openIPAM(ctx context.Context) error {
	var init ipalloc.Init
	switch r.cfg.Init.Kind {
	case "consensus":
		init.Consensus = r.cfg.Init.Quorum
		if init.Consensus == 0 {
			init.Consensus = 1 + len(r.otherTargets())
		}
	case "seed":
		for _, s := range r.cfg.Init.Seeds {
			init.Seeds = append(init.Seeds, ipalloc.PeerName(s))
		}
	case "observer":
		init.Observer = true
	}
	if r.kube != nil {
		claimed, err := ipalloc.HasRing(r.db)
		if err != nil {
			return err
		}
		if !claimed {
			if init, err = r.kubeInit(ctx, init); err != nil {
				return err
			}
		}
	}
	svc, err := ipalloc.NewService(ipalloc.ServiceConfig{
		Self: ipalloc.PeerName(r.name), Universe: r.cfg.Universe, Init: init, DB: r.db, Log: r.log,
		OnSave:  r.metrics.observeSave,
		GCGrace: r.cfg.GCGrace, Now: r.seams.now,
		// In --kube mode the ConfigMap's registered peers are the members
		// a peer that lost its state waits for (routineKube reads them).
		ExternalMembers: r.kube != nil,
	})
	if err != nil {
		return err
	}
	r.ipam = svc
	r.gossip = ipalloc.NewGossip(svc, r.log, nil)
	r.log.Info("ipalloc: first claim", "init", r.cfg.Init.String(), "expected-peers", init.Consensus, "observer", init.Observer)
	return nil
}

// otherTargets are the --peers entries that are not this node's own address.
func (r *Router) otherTargets() []string {
	host := r.net().host
	var out []string
	for _, p := range r.cfg.PeerList {
		h := p
		if ap, err := netip.ParseAddrPort(p); err == nil {
			h = ap.Addr().String()
		} else if i := strings.LastIndexByte(p, ':'); i > 0 && !strings.Contains(p[:i], ":") {
			h = p[:i]
		}
		if a, err := netip.ParseAddr(h); err == nil && a == host {
			continue
		}
		out = append(out, p)
	}
	return out
}

// resolvePeer turns an rmpeer argument (name or nickname) into a peer name.
func (r *Router) resolvePeer(arg string) (ipalloc.PeerName, error) {
	if r.mesh == nil {
		return ipalloc.PeerName(arg), nil
	}
	var byNick []mesh.Peer
	for _, p := range r.mesh.Peers() {
		if string(p.Name) == arg {
			return checkGone(p)
		}
		if p.Nickname == arg {
			byNick = append(byNick, p)
		}
	}
	switch len(byNick) {
	case 1:
		return checkGone(byNick[0])
	case 0:
		// Not in the view (forgotten, or never seen): the ring may still
		// name it.
		for _, s := range r.ipam.Snapshot().Ring.Shares() {
			if string(s.Peer) == arg {
				return s.Peer, nil
			}
		}
		return "", fmt.Errorf("no peer is named or nicknamed %q (see weft status peers / ipam)", arg)
	}
	return "", fmt.Errorf("%d peers are nicknamed %q; give the peer name", len(byNick), arg)
}

func checkGone(p mesh.Peer) (ipalloc.PeerName, error) {
	if p.Self {
		return "", fmt.Errorf("%s is this peer; to take it out of the cluster use weft reset on it", p.Name)
	}
	if p.State == mesh.StateAlive || p.State == mesh.StateSuspect {
		return "", fmt.Errorf("peer %s(%s) is alive; stop it first: rmpeer is for peers that are gone for good", p.Name, p.Nickname)
	}
	return ipalloc.PeerName(p.Name), nil
}

// alivePeers is the set of peers the mesh sees alive (or only suspected).
func (r *Router) alivePeers() map[ipalloc.PeerName]bool {
	alive := map[ipalloc.PeerName]bool{}
	if r.mesh == nil {
		return alive
	}
	for _, p := range r.mesh.Peers() {
		if !p.Self && (p.State == mesh.StateAlive || p.State == mesh.StateSuspect) {
			alive[ipalloc.PeerName(p.Name)] = true
		}
	}
	return alive
}

// reclaimFromBridge hands the allocator the addresses in use on the bridge,
// at every start: the bridge's own address in the pod range (held as the
// gateway, so that the pods keep their default route) and the pod-range
// addresses in its neighbour table (pods that talked to the gateway). The
// allocator holds each that its state does not hold already, as soon as it
// lies in a range this peer owns, and never one outside: when the state
// was lost (or the state dir is new on a node with pods), and when the
// state is older than what the peers know (a restored backup: the pods
// that got an address after the backup; docs/ipam.md#a-stale-disk).
func (r *Router) reclaimFromBridge() {
	seen, err := observeBridge(r.cfg.Bridge)
	if err != nil {
		r.log.Warn("cannot read the bridge to re-claim the addresses of its pods", "bridge", r.cfg.Bridge, "err", err)
		return
	}
	lost := r.ipam.Stats().Allocated == 0
	if !lost {
		// The state holds allocations: an address it does not hold is a
		// pod's only if that pod is behind a port now (one that got its
		// address after a restored backup), not the lingering neighbour
		// entry of a pod deleted before this start. With no state at all,
		// every neighbour counts: a pod silent for longer than the
		// bridge's ageing time has no forwarding entry, and must not lose
		// its address to another.
		seen.Neighbors = seen.Live
	}
	found := foundAddrs(r.cfg.Bridge, r.cfg.Universe, seen)
	if len(found) == 0 {
		return
	}
	if lost {
		r.log.Info("ipalloc: the state knows no allocation, but the bridge has pods: re-claiming their addresses once they are in this peer's ranges",
			"bridge", r.cfg.Bridge, "ports", seen.Ports, "addresses", len(found))
	}
	if err := r.ipam.HoldFound(found); err != nil {
		r.log.Error("ipalloc: re-claiming the addresses found on the bridge", "err", err)
	}
}
