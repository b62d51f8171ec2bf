package router

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"time"

	"github.com/weft-net/weft/internal/ipammesh"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/tunnel"
)

// State keys of the mesh's remembered peers.
const (
	bucketMesh    = "mesh"
	keyKnownPeers = "known-peers"
)

// newMesh makes the mesh with its targets: the --peers plus the peers
// remembered from the last run, joined once it starts (and retried in the
// background until reached).
func (r *Router) newMesh() error {
	remembered, err := r.loadKnownPeers()
	if err != nil {
		r.log.Warn("the remembered peers in the state are unreadable; joining --peers only", "err", err)
	}
	tun, err := tunnelMetaComponent(tunnelRecord{DataPort: uint16(r.cfg.DataPort), Encaps: r.encaps(), PublicKey: r.tunnel.PublicKey()})
	if err != nil {
		return fmt.Errorf("the tunnel's record in the mesh metadata: %w", err)
	}
	var vtep *tunnel.VTEP
	if v, ok := r.tunnel.LocalVTEP(); ok {
		vtep = &v
	}
	vx, err := vxlanMetaComponent(vtep)
	if err != nil {
		return fmt.Errorf("the vxlan record in the mesh metadata: %w", err)
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
		Components:    []mesh.Component{tun, vx},
		SecretKey:     r.gossipKey(),
		Version:       Version,
		Peers:         r.cfg.PeerList,
		Remembered:    remembered,
		Logger:        r.log,
		Registerer:    r.metrics.reg,
		Transport:     r.seams.gossip,
		Timings:       r.seams.meshTimings,
	})
	if err != nil {
		return err
	}
	if r.ipamCh, err = m.Channel(IPAMChannel, ipammesh.Gossiper{G: r.gossip}); err != nil {
		m.Close()
		return err
	}
	r.ipamTr = ipammesh.NewTransport(m, r.ipamCh)
	r.mesh = m
	r.knownPeers = remembered
	return nil
}

// meshSettle is how long after the mesh started a peer it has not seen
// alive may be taken for dead even though the mesh has not joined any peer
// yet (a lone survivor whose peers are all gone).
const meshSettle = 30 * time.Second

// startMesh starts the mesh (joining its targets in the background) and
// notes when, for meshSettled.
func (r *Router) startMesh(ctx context.Context) error {
	now := time.Now()
	r.meshSince.Store(&now)
	return r.mesh.Start(ctx)
}

// meshSettled reports whether the mesh's view of who is alive is
// meaningful: it has started and joined another peer (memberlist's join
// brings the other's whole view), or it started meshSettle ago.
func (r *Router) meshSettled() bool {
	since := r.meshSince.Load()
	if since == nil {
		return false
	}
	return len(r.alivePeers()) > 0 || time.Since(*since) >= meshSettle
}

// peerMaybeAlive is the Kubernetes side's guard against reclaiming the
// ranges of a live peer whose Node was deleted: true for a peer the mesh
// sees alive (or only suspects), and for every peer while the mesh has not
// settled: right after a restart the view is empty, and a peer that is not
// seen yet may well be alive.
func (r *Router) peerMaybeAlive(peer string) bool {
	if !r.meshSettled() {
		return true
	}
	return r.alivePeers()[ipalloc.PeerName(peer)]
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
	return decodeKnownPeers(data)
}

// maxKnownPeers bounds the remembered peers read back at start.
const maxKnownPeers = 10000

// decodeKnownPeers reads the remembered peers as saveKnownPeers wrote them.
func decodeKnownPeers(data []byte) ([]string, error) {
	var peers []string
	if err := json.Unmarshal(data, &peers); err != nil {
		return nil, fmt.Errorf("decoding %s/%s: %w", bucketMesh, keyKnownPeers, err)
	}
	if len(peers) > maxKnownPeers {
		peers = peers[:maxKnownPeers]
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
