package router

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/weft-net/weft/mesh"
)

// State keys of the mesh's remembered peers.
const (
	bucketMesh    = "mesh"
	keyKnownPeers = "known-peers"
)

// startMesh joins the mesh: the --peers targets plus the peers remembered
// from the last run, retried in the background until reached.
func (r *Router) startMesh(ctx context.Context) error {
	remembered, err := r.loadKnownPeers()
	if err != nil {
		r.log.Warn("the remembered peers in the state are unreadable; joining --peers only", "err", err)
	}
	host := r.net().host
	bind := ""
	if isLocalAddr(host) {
		bind = host.String() // gossip only on the underlay, never on the pod bridge
	}
	m, err := mesh.New(mesh.Config{
		Name:          mesh.PeerName(r.name),
		Nickname:      r.cfg.Nickname,
		BindAddr:      bind,
		AdvertiseAddr: host.String(),
		Port:          r.cfg.Port,
		DataPort:      r.cfg.DataPort,
		Encaps:        r.encaps(),
		PublicKey:     r.tunnel.PublicKey(),
		SecretKey:     r.gossipKey(),
		Version:       Version,
		Peers:         r.cfg.Peers,
		Remembered:    remembered,
		Logger:        r.log,
		Registerer:    r.metrics.reg,
	})
	if err != nil {
		return err
	}
	if r.ipamCh, err = m.Channel(IPAMChannel, ipamGossiper{r: r}); err != nil {
		m.Close()
		return err
	}
	if err := m.Start(ctx); err != nil {
		m.Close()
		return err
	}
	r.mesh = m
	r.knownPeers = remembered
	return nil
}

// gossipKey is the memberlist key derived from the password; nil without one.
func (r *Router) gossipKey() []byte {
	if r.keys == nil {
		return nil
	}
	return r.keys.Gossip[:]
}

// saveKnownPeers remembers the current peers for the next start, when they
// changed.
func (r *Router) saveKnownPeers() {
	if r.mesh == nil {
		return
	}
	known := r.mesh.KnownPeers()
	if slices.Equal(known, r.knownPeers) {
		return
	}
	data, err := json.Marshal(known)
	if err == nil {
		err = r.db.Put(bucketMesh, keyKnownPeers, data)
	}
	if err != nil {
		r.log.Warn("could not remember the known peers", "err", err)
		return
	}
	r.knownPeers = known
}

func (r *Router) loadKnownPeers() ([]string, error) {
	data, err := r.db.Get(bucketMesh, keyKnownPeers)
	if err != nil || len(data) == 0 {
		return nil, err
	}
	var peers []string
	if err := json.Unmarshal(data, &peers); err != nil {
		return nil, fmt.Errorf("decoding %s/%s: %w", bucketMesh, keyKnownPeers, err)
	}
	if len(peers) > 10000 {
		peers = peers[:10000]
	}
	return peers, nil
}

// isLocalAddr reports whether a is assigned to an interface of this namespace.
func isLocalAddr(a netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, x := range addrs {
		if n, ok := x.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a {
				return true
			}
		}
	}
	return false
}
