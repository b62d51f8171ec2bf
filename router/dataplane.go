package router

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weft-net/weft/bridge"
	"github.com/weft-net/weft/cni"
	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/mesh"
	"github.com/weft-net/weft/tunnel"
	"github.com/weft-net/weft/tunnel/crypt"
)

// dataplaneResync is how often the data plane re-applies its routes and
// peers even when nothing was signalled, so that a route deleted by hand
// comes back.
const dataplaneResync = 30 * time.Second

// openTunnel opens the data plane (the TUN device, the udp socket, IPIP)
// before the mesh starts, so that the mesh can advertise what this node
// can do.
func (r *Router) openTunnel() error {
	ns := r.net()
	listen := netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(r.cfg.DataPort))
	if isLocalAddr(ns.host) {
		listen = netip.AddrPortFrom(ns.host, uint16(r.cfg.DataPort)) // data only on the underlay
	}
	cfg := tunnel.Config{
		Self:           r.name,
		Mode:           r.cfg.EncapMode,
		MTU:            ns.mtu,
		UnderlayMTU:    ns.underlayMTU,
		Underlay:       ns.host,
		Listen:         listen,
		TrustedSubnets: r.cfg.TrustedPrefixes,
		VXLANPort:      uint16(r.cfg.VXLANPort),
		VNI:            uint32(r.cfg.VXLANVNI),
		Logger:         r.log,
		Registerer:     r.metrics.reg,
	}
	if r.keys != nil {
		cfg.PSK = r.keys.PSK[:]
	}
	d, err := r.kernel.NewTunnel(cfg)
	if err != nil {
		return fmt.Errorf("data plane: %w", err)
	}
	r.tunnel = d
	if err := r.metrics.reg.Register(newGuardCollector(r.kernel)); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
		return fmt.Errorf("registering the guard's metrics: %w", err)
	}
	return nil
}

// deriveKeys turns the password into the gossip key and the data plane's
// pre-shared key (a deliberately slow KDF: once, at start).
func (r *Router) deriveKeys() error {
	if r.cfg.Secret == nil {
		r.log.Warn("no password set: traffic between nodes (gossip and pod data) is NOT encrypted and any host that reaches the gossip port can join; set --password-file or WEFT_PASSWORD on every node")
		return nil
	}
	start := time.Now()
	keys, err := crypt.DeriveKeys(r.cfg.Secret)
	if err != nil {
		return fmt.Errorf("deriving keys from the password: %w", err)
	}
	r.keys = &keys
	r.log.Info("encryption enabled: gossip authenticated and encrypted, pod data sealed per peer", "kdf-time", time.Since(start).Round(time.Millisecond), "trusted-subnets", r.cfg.TrustedPrefixes)
	return nil
}

// encaps is what the mesh advertises: the modes this node can receive.
func (r *Router) encaps() []string {
	var out []string
	for _, m := range r.tunnel.Encaps() {
		out = append(out, string(m))
	}
	return out
}

// kickDataplane makes routineDataplane resynchronise now.
func (r *Router) kickDataplane() {
	select {
	case r.dataplaneKick <- struct{}{}:
	default:
	}
}

// routineDataplane keeps the tunnel's peers and routes in step with the
// mesh (who is where, and what it can do) and the ring (who owns what).
// Routes wait for the bridge's gateway: it is their source address.
func (r *Router) routineDataplane(ctx context.Context) {
	events, unsubscribe := r.mesh.Subscribe(256)
	defer unsubscribe()
	t := time.NewTicker(dataplaneResync)
	defer t.Stop()
	for {
		r.settleTunnel()
		r.syncPeers()
		r.syncRing()
		select {
		case <-ctx.Done():
			return
		case <-events:
		case <-r.ipam.RingChanged():
		case <-r.dataplaneKick:
		case <-t.C:
		}
	}
}

// tunnelPeers turns the mesh's view into the tunnel's peers: every peer
// that has not left, with a readable record (an unreachable peer keeps its
// ranges, and the data path to it may still work). A peer that left but
// has a VTEP is kept too: its router stopped, and its kernel's VXLAN
// device goes on carrying its pods' traffic (until rmpeer hands its
// ranges on, or the mesh forgets it).
func tunnelPeers(peers []mesh.Peer) []tunnel.Peer {
	var out []tunnel.Peer
	for _, p := range peers {
		if p.Self || p.MetaError != "" || !p.Addr.IsValid() {
			continue
		}
		t, ok := peerTunnelRecord(p)
		if !ok {
			continue // no record, or one refused (the mesh logged why)
		}
		vtep := peerVTEP(p)
		if p.State == mesh.StateLeft && vtep == nil {
			continue
		}
		out = append(out, tunnel.Peer{
			Name:      string(p.Name),
			Underlay:  p.Addr.Addr(),
			DataPort:  t.DataPort,
			Encaps:    tunnel.ParseEncaps(t.Encaps),
			VTEP:      vtep,
			PublicKey: t.PublicKey,
		})
	}
	return out
}

// settleTunnel ends the tunnel's hold on the kernel's vxlan entries once
// the mesh's view is meaningful (meshSettled): before, a peer not heard
// of yet may well be alive behind the entries a router before this one
// left.
func (r *Router) settleTunnel() {
	if r.tunnelSettled || !r.meshSettled() {
		return
	}
	if err := r.tunnel.Settle(); err != nil {
		r.log.Error("data plane: reconciling after the mesh settled", "err", err)
		return
	}
	r.tunnelSettled = true
}

func (r *Router) syncPeers() {
	peers := tunnelPeers(r.mesh.Peers())
	if err := r.tunnel.SetPeers(peers); err != nil {
		r.log.Error("data plane: updating peers", "err", err)
	}
	r.syncGuardPeers(peers, false)
}

// ownedRanges turns the ring into the tunnel's routing table.
func ownedRanges(ring *ipalloc.Ring) []tunnel.OwnedRange {
	var out []tunnel.OwnedRange
	for _, o := range ring.Ownership() {
		if o.Size() == 0 {
			continue
		}
		out = append(out, tunnel.OwnedRange{
			First: o.Start.Addr(),
			Last:  (o.End - 1).Addr(),
			Peer:  string(o.Peer),
		})
	}
	return out
}

func (r *Router) syncRing() {
	ranges := ownedRanges(r.ipam.Ring())
	r.syncGuardOwn(ranges, false)
	gw := r.net().gateway
	if !gw.IsValid() {
		return // no bridge address yet to source routes from
	}
	if slices.Equal(ranges, r.lastRanges) && !r.resyncDue() {
		return
	}
	if err := r.tunnel.SetRing(ranges, gw.Addr()); err != nil {
		r.log.Error("data plane: applying the ring's routes", "err", err)
		r.lastRanges = nil // try again on the next round
		return
	}
	r.lastRanges = ranges
	r.lastResync = time.Now()
	if err := r.syncPodSources(); err != nil {
		r.log.Error("guard: setting the pods' source addresses", "err", err)
	}
}

// resyncDue reports whether the routes were last applied long enough ago
// to check them against the kernel again.
func (r *Router) resyncDue() bool {
	return time.Since(r.lastResync) >= dataplaneResync
}

// ConnReport is one line of /status/connections: the mesh connection and
// the data path to the same peer.
type ConnReport struct {
	mesh.Connection
	// Mode is how data is sent to the peer: udp, ipip or "" (none).
	Mode      string `json:"mode,omitempty"`
	Kernel    bool   `json:"kernel,omitempty"`
	Encrypted bool   `json:"encrypted"`
	Trusted   bool   `json:"trusted,omitempty"` // in --trusted-subnets: plaintext on purpose
	// Reason says why this mode (tunnel.Connection.Reason): "no
	// password", "encrypted: outside trusted subnets", "the peer has no
	// vxlan", ...
	Reason string `json:"reason,omitempty"`
	// Path is the health of the peer's vxlan path as the probes show it
	// (tunnel.Connection.Path): "ok", "down since ...: why", "" where it
	// is not probed.
	Path      string `json:"path,omitempty"`
	DataError string `json:"dataError,omitempty"`
}

// connections joins the mesh's connections with the tunnel's data paths.
func (r *Router) connections() []ConnReport {
	var paths map[string]tunnel.Connection
	if r.tunnel != nil {
		paths = map[string]tunnel.Connection{}
		for _, c := range r.tunnel.Connections() {
			paths[c.Peer] = c
		}
	}
	var out []ConnReport
	for _, c := range r.mesh.Report().Connections {
		cr := ConnReport{Connection: c}
		if p, ok := paths[string(c.Peer)]; ok && c.Peer != "" {
			cr.Mode, cr.Kernel, cr.DataError = string(p.Mode), p.Kernel, p.Error
			cr.Encrypted, cr.Trusted, cr.Reason, cr.Path = p.Encrypted, p.Trusted, p.Reason, p.Path
		}
		out = append(out, cr)
	}
	return out
}

// WriteConnections writes the text of GET /status/connections, one line
// per connection:
//
//	-> address  established|failed  state  data-path  encryption  name(nickname)  [reason] [error]
//
// where data-path is udp, vxlan (kernel), ipip (kernel), ipip (userspace)
// or "-" when no data can be sent to the peer, encryption is encrypted,
// unencrypted or trusted (unencrypted because the peer is in
// --trusted-subnets), and reason why this data path ("no password",
// "encrypted: outside trusted subnets", "the peer has no vxlan", "vxlan
// path down since 10:02:03: no answer to 4 probes in a row", ...), and a
// vxlan path that is down while it is used (--encap vxlan).
func WriteConnections(w io.Writer, conns []ConnReport) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range conns {
		who, state, mode := "-", c.State, "-"
		if c.Peer != "" {
			who = fmt.Sprintf("%s(%s)", c.Peer, c.Nick)
		}
		if state == "" {
			state = "-"
		}
		switch {
		case c.Mode == string(tunnel.ModeIPIP) && c.Kernel:
			mode = "ipip (kernel)"
		case c.Mode == string(tunnel.ModeIPIP):
			mode = "ipip (userspace)"
		case c.Mode == string(tunnel.ModeVXLAN):
			mode = "vxlan (kernel)"
		case c.Mode != "":
			mode = c.Mode
		}
		crypto := "unencrypted"
		switch {
		case c.Mode == "":
			crypto = "-"
		case c.Encrypted:
			crypto = "encrypted"
		case c.Trusted:
			crypto = "trusted"
		}
		errs := []string{}
		if c.Reason != "" {
			errs = append(errs, c.Reason)
		}
		if c.Error != "" {
			errs = append(errs, c.Error)
		}
		if c.Path != "" && c.Path != "ok" && !strings.Contains(c.Reason, c.Path) {
			// Down (or not answered yet) while it is still used: --encap
			// vxlan has nothing to fall back to.
			errs = append(errs, "vxlan path "+c.Path)
		}
		if c.DataError != "" {
			errs = append(errs, "data: "+c.DataError)
		}
		fmt.Fprintf(tw, "-> %s\t%s\t%s\t%s\t%s\t%s\t%s\n", c.Address, c.Outcome, state, mode, crypto, who, strings.Join(errs, "; "))
	}
	return tw.Flush()
}

// guardState is the router's side of the bridge's guard (bridge.Guard):
// the peers and pod sets it keeps in step. One field of Router.
type guardState struct {
	mu        sync.Mutex // serialises the reconciles of the sets
	lastPeers []netip.Addr
	peersAt   time.Time
	lastOwn   []bridge.AddrRange // the own set last written
	ownAt     time.Time
	warnedAt  time.Time

	// batchMu guards next: the pod sources that ADDs wait to have in the
	// set (allowPodSource). Whoever takes mu first writes them all in one
	// kernel batch, for every waiter.
	batchMu sync.Mutex
	next    *podBatch
}

// podBatch is one group of pod sources added to the guard's set at once.
// flushed and err are written and read under guardState.mu.
type podBatch struct {
	pods    []bridge.PodSource
	flushed bool
	err     error
}

// bridgeConfig is the bridge's configuration, its guard with it: the
// routers' ports are closed to pods, and IPIP is taken only from peers
// where this node may receive it.
func (r *Router) bridgeConfig(ns netState) bridge.Config {
	return bridge.Config{
		Name: r.cfg.Bridge, MTU: ns.mtu, Gateway: ns.gateway, PodRange: r.cfg.Universe,
		Guard: bridge.Guard{
			GossipPort: uint16(r.cfg.Port), DataPort: uint16(r.cfg.DataPort),
			IPIPPeersOnly: r.tunnel != nil && r.tunnel.ReceivesIPIP(),
			VXLANPort:     r.vxlanGuardPort(),
			VXLANDevice:   r.vxlanGuardDevice(),
			VXLANProbePort: func() uint16 {
				if r.vxlanGuardDevice() == "" {
					return 0
				}
				return tunnel.ChecksumProbePort
			}(),
		},
	}
}

// vxlanGuardDevice is the kernel VXLAN device whose decapsulated packets
// the guard checks (their source neither outside the pod range nor in
// this node's own ranges); "" without vxlan.
func (r *Router) vxlanGuardDevice() string {
	if r.tunnel == nil {
		return ""
	}
	return r.tunnel.VXLANDevice()
}

// vxlanGuardPort is the VXLAN port the guard closes to pods and opens to
// peers only; 0 without vxlan.
func (r *Router) vxlanGuardPort() uint16 {
	if r.tunnel == nil {
		return 0
	}
	v, ok := r.tunnel.LocalVTEP()
	if !ok {
		return 0
	}
	return v.Port
}

// syncGuard brings the sets of the guard in step now: after the bridge
// was ensured (a first start makes them empty).
func (r *Router) syncGuard() {
	r.syncGuardPeers(tunnelPeers(r.mesh.Peers()), true)
	r.syncGuardOwn(ownedRanges(r.ipam.Ring()), true)
	if err := r.syncPodSources(); err != nil {
		r.log.Error("guard: setting the pods' source addresses", "err", err)
	}
}

// guardPeerAddrs is the guard's peers set, the underlay addresses that
// IPIP and VXLAN are accepted from: every peer's, or, with a password,
// only those inside the trusted subnets. Neither is sealed, so a peer
// outside them talks to this node over the sealed udp tunnel only, and
// plaintext "from" its address is someone who spoofs it.
func guardPeerAddrs(peers []tunnel.Peer, password bool, trusted []netip.Prefix) []netip.Addr {
	var addrs []netip.Addr
	for _, p := range peers {
		if !p.Underlay.Is4() {
			continue
		}
		if password && !slices.ContainsFunc(trusted, func(t netip.Prefix) bool { return t.Contains(p.Underlay) }) {
			continue
		}
		addrs = append(addrs, p.Underlay)
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	return slices.Compact(addrs)
}

// syncGuardPeers makes the guard's peers set guardPeerAddrs of peers, when
// they changed or force.
func (r *Router) syncGuardPeers(peers []tunnel.Peer, force bool) {
	addrs := guardPeerAddrs(peers, r.cfg.Secret != nil, r.cfg.TrustedPrefixes)
	g := &r.guard
	g.mu.Lock()
	defer g.mu.Unlock()
	if !force && slices.Equal(addrs, g.lastPeers) && time.Since(g.peersAt) < dataplaneResync {
		return
	}
	added, removed, err := r.kernel.SetGuardPeers(addrs)
	switch {
	case errors.Is(err, bridge.ErrNoGuard):
		return // the bridge is not ensured yet; syncGuard follows it
	case err != nil:
		r.log.Error("guard: setting the peers' addresses", "err", err)
		return
	}
	if added+removed > 0 {
		r.log.Debug("guard: peers' addresses updated", "added", added, "removed", removed, "peers", len(addrs))
	}
	g.lastPeers, g.peersAt = addrs, time.Now()
}

// guardOwnRanges are this node's ranges of the ring (peer self), the
// guard's own set.
func guardOwnRanges(ranges []tunnel.OwnedRange, self string) []bridge.AddrRange {
	var out []bridge.AddrRange
	for _, o := range ranges {
		if o.Peer == self {
			out = append(out, bridge.AddrRange{First: o.First, Last: o.Last})
		}
	}
	return out
}

// syncGuardOwn makes the guard's own set this node's ranges of ranges
// (the ring's), when they changed, on every resync, or when force. A
// donation leaves the donor's set first (its ring changes first), so
// the receiver's pods are never dropped as the donor's own.
func (r *Router) syncGuardOwn(ranges []tunnel.OwnedRange, force bool) {
	own := guardOwnRanges(ranges, r.name)
	g := &r.guard
	g.mu.Lock()
	defer g.mu.Unlock()
	if !force && slices.Equal(own, g.lastOwn) && time.Since(g.ownAt) < dataplaneResync {
		return
	}
	changed, err := r.kernel.SetGuardOwnRanges(own)
	switch {
	case errors.Is(err, bridge.ErrNoGuard):
		return // the bridge is not ensured yet; syncGuard follows it
	case err != nil:
		r.log.Error("guard: setting this node's ranges", "err", err)
		return
	}
	if changed {
		r.log.Debug("guard: this node's ranges updated", "ranges", len(own))
	}
	g.lastOwn, g.ownAt = own, time.Now()
}

// podSources are the pods' rights to send, from the allocator: the host
// veth of each attachment (cni.HostVethName) with its address. Addresses
// held as re-claimed from the bridge (their attachment is unknown) are
// returned apart: whatever the kernel's set has for them is kept.
func podSources(held []ipalloc.Held) (want []bridge.PodSource, reclaimed map[netip.Addr]bool) {
	reclaimed = map[netip.Addr]bool{}
	for _, h := range held {
		k, addr := h.Key, h.Address.Addr()
		if k.Reclaimed() {
			reclaimed[addr] = true
		} else if p, ok := podSource(k, addr); ok {
			want = append(want, p)
		}
	}
	return want, reclaimed
}

// syncPodSources makes the guard's pods set what the allocator holds:
// called after GC, after the release of an address re-claimed from the
// bridge (whose veth is unknown), and on every resync; an ADD and a plain
// DEL change only their own entry (allowPodSource, withdrawPodSource). Before the bridge is
// ensured it does nothing (the bridge's Ensure is followed by syncGuard).
func (r *Router) syncPodSources() error {
	g := &r.guard
	g.mu.Lock()
	defer g.mu.Unlock()
	want, reclaimed := podSources(r.ipam.Snapshot().Allocations)
	added, removed, err := r.kernel.SetPodSources(want, func(p bridge.PodSource) bool { return reclaimed[p.Addr] })
	switch {
	case errors.Is(err, bridge.ErrNoGuard):
		return nil
	case err != nil:
		return err
	}
	for _, p := range added {
		r.log.Debug("guard: pod may send", "veth", p.Veth, "address", p.Addr)
	}
	for _, p := range removed {
		r.log.Debug("guard: pod source withdrawn", "veth", p.Veth, "address", p.Addr)
	}
	return nil
}

// podSource is the guard's entry of one allocation, false for keys that
// are no pod (the gateway, addresses re-claimed from the bridge).
func podSource(k ipalloc.Key, addr netip.Addr) (bridge.PodSource, bool) {
	if k.Reclaimed() || k.Internal() {
		return bridge.PodSource{}, false
	}
	return bridge.PodSource{Veth: cni.HostVethName(k.ContainerID, k.IfName), Addr: addr}, true
}

// allowPodSource puts one pod's source into the guard's set (and removes
// nothing): called before the local API answers an ADD. It costs one
// kernel batch that only adds (Kernel.AddPodSources: the set is neither
// read nor looked up), not a walk of every allocation (the full reconcile,
// syncPodSources, runs at start, after GC and on every resync).
// Concurrent ADDs share a batch: the first to take the guard's lock
// writes every source queued by then, the others find theirs written
// when they get the lock. It returns only once p is in the set (or with
// the error of the batch that tried); before the bridge is ensured it
// does nothing (syncGuard follows Ensure with the full reconcile).
func (r *Router) allowPodSource(p bridge.PodSource) error {
	g := &r.guard
	g.batchMu.Lock()
	b := g.next
	if b == nil {
		b = &podBatch{}
		g.next = b
	}
	b.pods = append(b.pods, p)
	g.batchMu.Unlock()

	g.mu.Lock()
	defer g.mu.Unlock()
	if b.flushed {
		return b.err
	}
	// The ADDs that became runnable with this one (the allocator answers
	// a step's waiters together) get one turn first, to join this batch
	// rather than each write one of their own: a yield, not a wait.
	runtime.Gosched()
	g.batchMu.Lock()
	if g.next == b {
		g.next = nil // later ADDs start the next batch
	}
	pods := b.pods // no one appends to b any more
	g.batchMu.Unlock()
	err := r.kernel.AddPodSources(pods)
	if errors.Is(err, bridge.ErrNoGuard) {
		err = nil
	}
	b.flushed, b.err = true, err
	if err == nil && r.log.Enabled(context.Background(), slog.LevelDebug) {
		for _, p := range pods {
			r.log.Debug("guard: pod may send", "veth", p.Veth, "address", p.Addr)
		}
	}
	return err
}

// allowPodSourceOf is allowPodSource for the allocation of k at addr.
func (r *Router) allowPodSourceOf(k ipalloc.Key, addr netip.Addr) error {
	p, ok := podSource(k, addr)
	if !ok {
		return nil
	}
	return r.allowPodSource(p)
}

// withdrawPodSource takes one released pod's source out of the guard's
// set, and nothing else (an ADD's entry of the same address on another
// veth stays).
func (r *Router) withdrawPodSource(p bridge.PodSource) error {
	g := &r.guard
	g.mu.Lock()
	defer g.mu.Unlock()
	removed, err := r.kernel.RemovePodSource(p)
	switch {
	case errors.Is(err, bridge.ErrNoGuard):
		return nil
	case err != nil:
		return err
	}
	if removed {
		r.log.Debug("guard: pod source withdrawn", "veth", p.Veth, "address", p.Addr)
	}
	return nil
}

// guardCollector exports the guard's drops (bridge.DropCounts) as
// weft_guard_dropped_packets_total{reason}, read from the kernel's rule
// counters at each scrape.
type guardCollector struct {
	kernel Kernel
	desc   *prometheus.Desc
}

func newGuardCollector(k Kernel) *guardCollector {
	return &guardCollector{kernel: k, desc: prometheus.NewDesc("weft_guard_dropped_packets_total",
		"Packets the node's nftables guard dropped, by reason (pod-to-router: a pod to a router's gossip or data port, or IPIP from a pod; ipip-non-peer: IPIP from an address that is no peer; pod-spoofed-source, pod-spoofed-arp: a pod sending with an address not its own; pod-protocol: a pod's frame that is neither IPv4 nor ARP; vxlan-non-peer: VXLAN from an address that is no peer; vxlan-spoofed-source: a packet out of the VXLAN device with a source outside the pod range or in this node's own ranges; vxlan-not-to-pods: a packet out of the VXLAN device to an address outside the pod range). Counts restart when weft rewrites its tables.",
		[]string{"reason"}, nil)}
}

func (c *guardCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *guardCollector) Collect(ch chan<- prometheus.Metric) {
	counts, err := c.kernel.GuardDrops()
	if err != nil {
		return // no sample rather than a failed scrape of every metric
	}
	for _, reason := range bridge.DropReasons {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(counts[reason]), reason)
	}
}
