package tunnel

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/weft-net/weft/tunnel/conn"
	"github.com/weft-net/weft/tunnel/crypt"
	"github.com/weft-net/weft/tunnel/tun"
)

// Defaults of Config.
const (
	DefaultTUNName  = "weft-tun"
	DefaultIPIPName = "weft-ipip"
	DefaultDataPort = 6784
	maxQueues       = 4
)

// Config configures a Device.
type Config struct {
	Self string // this peer's name
	Mode Mode   // --encap: udp, vxlan, ipip or auto

	TUNName  string // the TUN device; DefaultTUNName if empty
	IPIPName string // the kernel IPIP device; DefaultIPIPName if empty
	// VXLANName, VXLANPort and VNI are the kernel VXLAN device of the
	// vxlan mode (--vxlan-port, --vxlan-vni): DefaultVXLANName,
	// DefaultVXLANPort and DefaultVNI if zero. Every node must use the
	// same port and VNI.
	VXLANName string
	VXLANPort uint16
	VNI       uint32
	// MTU is the TUN device's MTU: the pod MTU, from PodMTU.
	MTU int
	// UnderlayMTU is the underlay interface's MTU; a packet bigger than
	// it allows after the encapsulation's overhead is answered with an
	// ICMP "fragmentation needed". Zero means MTU + Overhead(Mode).
	UnderlayMTU int
	// Underlay is this node's underlay address: the local end of the
	// kernel IPIP device. Kernel IPIP is not tried without it.
	Underlay netip.Addr
	// Listen is where the udp data socket listens; 0.0.0.0:DefaultDataPort
	// if invalid.
	Listen netip.AddrPort
	// Queues is the number of TUN queues (IFF_MULTI_QUEUE when above
	// one); zero means one per CPU, at most 4.
	Queues int
	// NoOffload turns off TCP segmentation offload on the TUN device and
	// UDP GSO/GRO on the socket (for a kernel or NIC that mishandles
	// them): every packet then crosses the kernel on its own, several
	// times slower.
	NoOffload bool

	// PSK turns encryption on: the data plane's pre-shared key that
	// crypt.DeriveKeys makes from the password (KeySize bytes). Frames
	// to and from every peer outside TrustedSubnets are then sealed with
	// per-peer session keys (see docs/security.md), plaintext from such
	// a peer is dropped, and ipip is used only inside TrustedSubnets.
	// Nil: no encryption, as before.
	PSK []byte
	// TrustedSubnets (--trusted-subnets) are underlay subnets whose
	// peers get plaintext frames (or ipip) and may send plaintext, as
	// Weave allowed. Only used with PSK.
	TrustedSubnets []netip.Prefix
	// KeyPair is this node's X25519 key pair, whose public key goes into
	// the mesh metadata (PublicKey); New makes a fresh one when it is nil
	// and PSK is set. Never store it.
	KeyPair *crypt.KeyPair
	// Rekey tunes when session keys change; zero fields take crypt's
	// defaults (for tests).
	Rekey crypt.Limits
	// Now is the clock of rekeying; time.Now if nil.
	Now func() time.Time

	Logger     *slog.Logger
	Registerer prometheus.Registerer // nil registers nothing

	// The seams at the kernel. If TUN is nil, New opens the kernel's
	// devices and sockets in the calling thread's network namespace
	// (Linux only). If TUN is set, New opens nothing: a nil UDP or IPIP
	// means that mode is not available, and a nil Routing that kernel
	// routes are not touched.
	TUN     tun.Device
	UDP     conn.Bind
	IPIP    conn.Bind // userspace IPIP (a raw socket of protocol 4)
	Routing RouteApplier
	// VTEPs, with TUN set, makes vxlan available (its device is taken to
	// exist) and keeps its neighbours and FDB entries.
	VTEPs VTEPApplier
	// Prober, with TUN and VTEPs set, probes the vxlan paths (nil: they
	// are not probed). Without TUN, New opens the kernel's (probe_linux.go).
	Prober PathProber
}

// RouteApplier makes the kernel's routes into the tunnel the wanted ones.
type RouteApplier interface {
	// Apply adds, replaces and removes routes on the tunnel devices so
	// that they are exactly want, and returns what it changed.
	Apply(want []Route) (added, removed []Route, err error)
	Close() error
}

// Device is one node's data plane: the TUN device, the underlay sockets
// and the goroutines that move packets between them.
//
// Run starts the goroutines; Close (or the end of Run's context) closes
// the TUN device and the sockets, which ends every goroutine, then the
// route applier. The kernel IPIP device, where there is one, is left in
// place, so that its traffic keeps flowing while the router restarts.
type Device struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	tun     tun.Device
	binds   [numWireModes]conn.Bind // nil where the mode has no userspace socket
	kernel  bool                    // ipip is kernel IPIP (no userspace socket)
	local   []Mode                  // what this node can do, fastest first
	routing RouteApplier
	tunSrc  netip.Addr // the address SetSourceAddr last gave the TUN device; SetRing clears it to check again
	vxSrc   netip.Addr // and the VXLAN device
	vtep    *VTEP      // this node's end of vxlan; nil: no vxlan
	// noVXLAN says, with auto and no vtep, why this node has no vxlan
	// (for the reason of each peer's choice).
	noVXLAN string
	vteps   VTEPApplier // the VXLAN device's neighbours and FDB
	// vtepsDone is the entries applyVTEPsLocked last made the device
	// hold, valid while vtepsOK (false after a failure: redo).
	vtepsDone []VTEPEntry
	vtepsOK   bool
	// routesDone is the routes applyRoutesLocked last made the kernel
	// hold, valid while routesOK (false after a failure: read and redo).
	routesDone []Route
	routesOK   bool
	checkedAt  time.Time // when SetRing last read the kernel back

	maxInner [numWireModes]int // largest inner packet per mode
	bufSize  int               // receive buffers: the largest datagram we accept
	counter  atomic.Uint64     // frame counter of plaintext frames

	crypto  *crypt.Local // nil: encryption off
	trusted []netip.Prefix
	ipipOK  bool // ipip may be used: no encryption, or some trusted subnets
	now     func() time.Time
	warns   dropWarnings

	snap atomic.Pointer[snapshot] // what the packet path reads

	mu       sync.Mutex // guards the fields below and serialises updates of snap
	peers    []Peer
	peersOK  bool // the last rebuild for peers succeeded (SetPeers may skip the same peers)
	ranges   []OwnedRange
	src      netip.Addr
	ringOK   bool                    // SetRing was called
	sessions map[string]*peerSession // by peer name, kept a while after the peer left
	// held: the VXLAN device's routes and entries found at start are
	// kept until Settle (the mesh has not told of every peer yet).
	held bool
	// prober probes the vxlan paths (nil: not probed); health is what
	// the probes showed, by peer name (probe.go).
	prober     PathProber
	health     map[string]*pathHealth
	csumOut    map[uint64]string // the nonce of each checksum probe out this round -> its peer
	probeErrAt time.Time         // the last warning about a probe not sent

	closeOnce sync.Once
	closeErr  error
	closed    chan struct{}
	running   atomic.Bool
}

// snapshot is an immutable view of the ring and the peers for the packet
// path: one atomic load per batch, no locks.
type snapshot struct {
	routes *Table
	peers  map[string]*peerPath
	byAddr map[netip.Addr]string
}

// peerPath is how packets reach one peer.
type peerPath struct {
	Peer
	mode   Mode   // what auto picked (or the configured mode); "" if none
	why    string // why this mode (auto's choice), for the log and status
	err    error  // why there is no mode
	tunIdx int    // wire mode for packets that reach the TUN device, -1 if none
	dst    [numWireModes]netip.AddrPort

	// vxlan is the peer's VTEP when vxlan may be used with it (its
	// entries are on the VXLAN device and its path is probed), also
	// while auto sends it udp because the path is down; nil otherwise.
	vxlan *VTEP
	path  string // the vxlan path's health, for status ("" if not probed)

	plain   bool           // plaintext both ways: encryption off, or a trusted peer
	trusted bool           // encryption on, and the peer is in a trusted subnet
	sess    *crypt.Session // the peer's session keys; nil without its public key
	noKey   bool           // its traffic is dropped for want of a public key
}

// New sets a Device up; Run starts it.
func New(cfg Config) (*Device, error) {
	if cfg.Self == "" {
		return nil, errors.New("tunnel: Self (this peer's name) is empty")
	}
	switch cfg.Mode {
	case ModeUDP, ModeIPIP, ModeVXLAN, ModeAuto:
	default:
		return nil, fmt.Errorf("unknown --encap %q: use one of udp, vxlan, ipip, auto", cfg.Mode)
	}
	if cfg.VXLANName == "" {
		cfg.VXLANName = DefaultVXLANName
	}
	if cfg.VXLANPort == 0 {
		cfg.VXLANPort = DefaultVXLANPort
	}
	if cfg.VNI == 0 {
		cfg.VNI = DefaultVNI
	}
	if cfg.VNI > MaxVNI {
		return nil, fmt.Errorf("--vxlan-vni %d out of range 1..%d", cfg.VNI, MaxVNI)
	}
	if cfg.TUNName == "" {
		cfg.TUNName = DefaultTUNName
	}
	if cfg.IPIPName == "" {
		cfg.IPIPName = DefaultIPIPName
	}
	if cfg.MTU < MinMTU || cfg.MTU > 65535 {
		return nil, fmt.Errorf("tunnel MTU %d out of range %d..65535", cfg.MTU, MinMTU)
	}
	if cfg.UnderlayMTU == 0 {
		cfg.UnderlayMTU = cfg.MTU + Overhead(cfg.Mode)
	}
	if !cfg.Listen.IsValid() {
		cfg.Listen = netip.AddrPortFrom(netip.IPv4Unspecified(), DefaultDataPort)
	}
	if cfg.Queues == 0 {
		cfg.Queues = min(runtime.NumCPU(), maxQueues)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	d := &Device{cfg: cfg, log: cfg.Logger, closed: make(chan struct{}), now: cfg.Now, sessions: map[string]*peerSession{}, held: true, health: map[string]*pathHealth{}, csumOut: map[uint64]string{}}
	if err := d.setupCrypto(); err != nil {
		return nil, err
	}
	if cfg.Mode == ModeAuto {
		d.noVXLAN = d.autoVXLANBlocked()
	}
	// The largest datagram accepted: what fits the underlay, or a frame
	// of a full TUN packet (sent fragmented when it does not fit).
	d.bufSize = max(cfg.UnderlayMTU, cfg.MTU+FrameHeaderLen+AEADTagLen)
	if cfg.TUN != nil {
		d.bufSize = max(d.bufSize, cfg.TUN.MTU()+FrameHeaderLen+AEADTagLen)
	}
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("registering tunnel metrics: %w", err)
	}
	d.metrics = met
	if cfg.TUN == nil {
		if err := d.openKernel(); err != nil {
			d.metrics.unregister(cfg.Registerer)
			return nil, err
		}
	} else {
		d.tun, d.routing = cfg.TUN, cfg.Routing
		d.binds[idxUDP], d.binds[idxIPIP] = cfg.UDP, cfg.IPIP
		switch {
		case cfg.Mode == ModeAuto && d.noVXLAN != "":
		case cfg.VTEPs == nil:
			if cfg.Mode == ModeAuto {
				d.noVXLAN = "no VXLAN device"
			}
		case cfg.Mode == ModeVXLAN || cfg.Mode == ModeAuto:
			d.vteps, d.prober = cfg.VTEPs, cfg.Prober
			d.vtep = &VTEP{MAC: VTEPMAC(cfg.Self), Addr: cfg.Underlay, Port: cfg.VXLANPort, VNI: cfg.VNI}
		}
	}
	d.local = d.capabilities()
	if cfg.Mode != ModeAuto && !slices.Contains(d.local, cfg.Mode) {
		d.Close()
		alt := "udp"
		if cfg.Mode == ModeUDP {
			alt = "vxlan"
		}
		return nil, fmt.Errorf("this node cannot do --encap %s: use --encap %s or auto", cfg.Mode, alt)
	}
	if len(d.local) == 0 {
		d.Close()
		return nil, errors.New("this node can do no encapsulation: neither the udp socket nor IPIP is available")
	}
	for i, m := range wireModes {
		d.maxInner[i] = cfg.UnderlayMTU - overheads[m]
	}
	d.snap.Store(&snapshot{peers: map[string]*peerPath{}, byAddr: map[netip.Addr]string{}})
	d.log.Info("tunnel ready", "device", d.tun.Name(), "mode", cfg.Mode, "can", modeList(d.local),
		"kernel-ipip", d.kernel, "vxlan", d.vtepString(), "mtu", cfg.MTU, "underlay-mtu", cfg.UnderlayMTU, "queues", len(d.tun.Queues()),
		"offloads", d.offloads(), "encryption", d.Encryption().String(), "trusted-subnets", prefixList(d.trusted))
	if d.crypto == nil {
		d.log.Info("data plane unencrypted: no password set; udp frames cross the underlay in the clear")
	}
	return d, nil
}

// offloads names the offloads in use, for the log.
func (d *Device) offloads() string {
	var on []string
	if o, ok := d.tun.(interface{ Offload() bool }); ok && o.Offload() {
		on = append(on, "tun-tso")
	}
	if o, ok := d.binds[idxUDP].(interface{ Offload() (bool, bool) }); ok {
		if gso, gro := o.Offload(); gso || gro {
			on = append(on, "udp-gso/gro")
		}
	}
	if len(on) == 0 {
		return "none"
	}
	return strings.Join(on, ",")
}

// capabilities lists the modes this node can use, fastest first: kernel
// IPIP (the least overhead, no Ethernet header), then the kernel's VXLAN
// device; between the userspace paths, udp measured faster than
// userspace IPIP (docs/benchmarks.md) and keeps checksums.
func (d *Device) capabilities() []Mode {
	var out []Mode
	if d.kernel {
		out = append(out, ModeIPIP)
	}
	if d.vtep != nil {
		out = append(out, ModeVXLAN)
	}
	if d.binds[idxUDP] != nil {
		out = append(out, ModeUDP)
	}
	if !d.kernel && d.binds[idxIPIP] != nil && d.ipipOK {
		out = append(out, ModeIPIP)
	}
	return out
}

// Encaps is what this node advertises to its peers: with auto, every mode
// it can do, fastest first; otherwise the configured mode.
func (d *Device) Encaps() []Mode {
	if d.cfg.Mode != ModeAuto {
		return []Mode{d.cfg.Mode}
	}
	return slices.Clone(d.local)
}

// LocalVTEP is this node's end of the vxlan overlay, for its mesh
// metadata; false without vxlan.
func (d *Device) LocalVTEP() (VTEP, bool) {
	if d.vtep == nil {
		return VTEP{}, false
	}
	return *d.vtep, true
}

// VXLANDevice is the name of the kernel VXLAN device this node receives
// vxlan on; "" without vxlan.
func (d *Device) VXLANDevice() string {
	if d.vtep == nil {
		return ""
	}
	return d.cfg.VXLANName
}

func (d *Device) vtepString() string {
	if d.vtep == nil {
		return "off"
	}
	return d.cfg.VXLANName + " " + d.vtep.String()
}

// Settle ends the hold on what the VXLAN device had at start: until it is
// called, its routes to peers not heard of yet and every neighbour and FDB
// entry are kept, so that a router that restarts does not cut the traffic
// the kernel kept carrying while the mesh tells it who is where. The
// router calls it once the mesh has settled; it then reconciles at once.
func (d *Device) Settle() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.held {
		return nil
	}
	d.held = false
	if d.vtep == nil {
		return nil
	}
	d.log.Info("vxlan: the mesh has settled; entries of peers that are gone are removed from now on", "device", d.cfg.VXLANName)
	err := d.applyVTEPsLocked(true)
	if d.ringOK {
		err = errors.Join(err, d.applyRoutesLocked(true))
	}
	return err
}

// KernelIPIP reports whether ipip traffic goes through the kernel's IPIP
// device rather than the userspace path.
func (d *Device) KernelIPIP() bool { return d.kernel }

// ReceivesIPIP reports whether this node may receive ipip: through the
// kernel IPIP device or the userspace raw socket.
func (d *Device) ReceivesIPIP() bool { return d.kernel || d.binds[idxIPIP] != nil }

// ModeFor is the mode this node sends to peer with ("" when the peer is
// unknown or has no mode in common with this node).
func (d *Device) ModeFor(peer string) Mode {
	if p := d.snap.Load().peers[peer]; p != nil {
		return p.mode
	}
	return ""
}

// Connection is one peer's data path, for status.
type Connection struct {
	Peer       string         `json:"peer"`
	Address    netip.AddrPort `json:"address"` // where its data goes (port 0 for ipip)
	Mode       Mode           `json:"mode,omitempty"`
	Kernel     bool           `json:"kernel,omitempty"` // through kernel IPIP or VXLAN
	Advertised []Mode         `json:"advertised,omitempty"`
	// Encrypted says frames to the peer are sealed (and plaintext from
	// it is refused).
	Encrypted bool `json:"encrypted"`
	// Trusted says the peer is in a trusted subnet: plaintext both ways
	// although encryption is on.
	Trusted bool `json:"trusted,omitempty"`
	// Reason says why this mode: with auto, what allows it ("no
	// password", "trusted subnet") or why a faster one is not used
	// ("encrypted: outside trusted subnets", "the peer has no vxlan").
	Reason string `json:"reason,omitempty"`
	// Path is the health of the peer's vxlan path as the probes show it
	// ("ok", "down since 10:02:03: no answer to 4 probes in a row"), ""
	// where it is not probed.
	Path  string `json:"path,omitempty"`
	Error string `json:"error,omitempty"`
}

// Connections lists every peer's data path, sorted by name.
func (d *Device) Connections() []Connection {
	s := d.snap.Load()
	out := make([]Connection, 0, len(s.peers))
	for _, p := range s.peers {
		c := Connection{Peer: p.Name, Mode: p.mode, Advertised: p.Encaps, Kernel: p.mode == ModeIPIP && d.kernel || p.mode == ModeVXLAN,
			Encrypted: p.mode != "" && !p.plain && p.sess != nil, Trusted: p.trusted, Reason: p.why, Path: p.path}
		if p.mode != "" {
			c.Address = p.addr()
		}
		if p.err != nil {
			c.Error = p.err.Error()
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b Connection) int { return strings.Compare(a.Peer, b.Peer) })
	return out
}

// SetPeers replaces the peers this node knows (the mesh's view; this node
// itself, if in the list, is ignored), picks a mode for each and logs
// every change of mode. Routes are re-applied when a peer moved between
// the kernel IPIP device and the TUN device.
//
// The router calls it on every mesh event with the whole view, and most
// events change nothing here (a peer's metadata gossiped again, a peer
// suspected and alive again): the same peers as the last call, whose
// rebuild succeeded, return at once. A rebuild costs about 2 µs per peer
// (2 ms at 1,000: BenchmarkSealedPeers), so without this a cluster of N
// forming cost each node O(N²).
func (d *Device) SetPeers(peers []Peer) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.peersOK && slices.EqualFunc(peers, d.peers, samePeer) {
		return nil
	}
	d.peers = slices.Clone(peers)
	return d.rebuildLocked()
}

// samePeer reports whether a and b describe a peer alike.
func samePeer(a, b Peer) bool {
	return a.Name == b.Name && a.Underlay == b.Underlay && a.DataPort == b.DataPort &&
		slices.Equal(a.Encaps, b.Encaps) && sameVTEP(a.VTEP, b.VTEP) && bytes.Equal(a.PublicKey, b.PublicKey)
}

// rebuildLocked makes the snapshot of the peers again (after a change of
// the peers, or of a vxlan path's health), logs every change of mode and
// applies the VXLAN device's entries and the routes that changed.
func (d *Device) rebuildLocked() error {
	old := d.snap.Load()
	next := d.buildLocked(old.routes)
	for name, p := range next.peers {
		o := old.peers[name]
		switch {
		case o == nil || o.mode != p.mode || o.why != p.why || o.plain != p.plain || (o.sess == nil) != (p.sess == nil):
			switch {
			case p.noKey:
				d.log.Warn(fmt.Sprintf("peer %s: %v; its traffic is dropped", name, p.err), "peer", name)
			case p.mode == "":
				d.log.Warn(fmt.Sprintf("peer %s: no encapsulation in common; its traffic is dropped", name), "peer", name, "err", p.err)
			default:
				d.log.Info(fmt.Sprintf("peer %s: %s (%s)", name, p.mode, p.why), "peer", name, "mode", p.mode, "protection", p.protection(),
					"address", p.addr(), "kernel", p.mode == ModeIPIP && d.kernel || p.mode == ModeVXLAN, "encrypted", !p.plain)
			}
		case o.Underlay != p.Underlay || o.DataPort != p.DataPort || !sameVTEP(o.VTEP, p.VTEP):
			d.log.Info(fmt.Sprintf("peer %s moved to %s", name, p.addr()), "peer", name)
		}
		d.setPeerModeMetricLocked(name, o, p)
	}
	for name, o := range old.peers {
		if next.peers[name] == nil {
			d.metrics.peerMode.DeleteLabelValues(name, metricMode(o.mode))
		}
	}
	d.snap.Store(next)
	var err error
	if d.vtep != nil {
		err = d.applyVTEPsLocked(false)
	}
	if (d.kernel || d.vtep != nil) && d.ringOK && routeTargetsDiffer(old, next) {
		err = errors.Join(err, d.applyRoutesLocked(false))
	}
	d.peersOK = err == nil
	return err
}

func metricMode(m Mode) string {
	if m == "" {
		return "none"
	}
	return string(m)
}

func (d *Device) setPeerModeMetricLocked(name string, o, p *peerPath) {
	if o != nil && o.mode != p.mode {
		d.metrics.peerMode.DeleteLabelValues(name, metricMode(o.mode))
	}
	d.metrics.peerMode.WithLabelValues(name, metricMode(p.mode)).Set(1)
}

// routeTargetsDiffer reports whether some peer's kernel route would change.
func routeTargetsDiffer(a, b *snapshot) bool {
	for name, p := range b.peers {
		o := a.peers[name]
		if o == nil || o.mode != p.mode || o.Underlay != p.Underlay || !sameVTEP(o.VTEP, p.VTEP) {
			return true
		}
	}
	return len(a.peers) != len(b.peers)
}

// buildLocked makes the snapshot for the current peers and routes.
func (d *Device) buildLocked(routes *Table) *snapshot {
	s := &snapshot{routes: routes, peers: map[string]*peerPath{}, byAddr: map[netip.Addr]string{}}
	present := map[string]bool{}
	for _, p := range d.peers {
		if p.Name == d.cfg.Self || p.Name == "" {
			continue
		}
		present[p.Name] = true
		pp := &peerPath{Peer: p, tunIdx: -1}
		pp.Encaps = slices.Clone(p.Encaps)
		pp.PublicKey = slices.Clone(p.PublicKey)
		keyErr := d.securePathLocked(pp)
		port := p.DataPort
		if port == 0 {
			port = DefaultDataPort
		}
		pp.dst[idxUDP] = netip.AddrPortFrom(p.Underlay, port)
		pp.dst[idxIPIP] = netip.AddrPortFrom(p.Underlay, 0)
		pp.VTEP = nil // set below if vxlan is used with the peer
		switch {
		case !p.Underlay.Is4():
			pp.err = fmt.Errorf("peer %s has no IPv4 underlay address (%v)", p.Name, p.Underlay)
		case !pp.plain:
			pp.mode, pp.err = chooseSealedMode(d.cfg.Mode, d.local, p.Encaps)
			pp.why = d.sealedWhy()
			if pp.mode != "" && pp.sess == nil {
				pp.mode, pp.err, pp.noKey = "", keyErr, true
			}
		default:
			pp.mode, pp.why, pp.err = d.choosePlain(p, pp.trusted)
		}
		if pp.mode == "" {
			pp.why = ""
		}
		if pp.mode == ModeVXLAN {
			v := *p.VTEP
			pp.VTEP, pp.vxlan = &v, &v
		}
		if pp.mode != "" {
			pp.tunIdx = modeIndex(pp.mode)
			if pp.mode == ModeIPIP && d.kernel || pp.mode == ModeVXLAN {
				// Its routes go to the kernel IPIP device; a packet that
				// still reaches the TUN device (a route being changed)
				// goes by udp if the peer has it.
				pp.tunIdx = -1
				if d.canUDP(&p) {
					pp.tunIdx = idxUDP
				}
			}
		}
		s.peers[p.Name] = pp
		if p.Underlay.IsValid() {
			s.byAddr[p.Underlay] = p.Name
		}
	}
	d.parkSessionsLocked(present)
	if d.vtep != nil {
		_, clash := vtepEntries(s.peers)
		for name, err := range clash {
			p := s.peers[name]
			p.mode, p.err, p.why, p.tunIdx, p.VTEP, p.vxlan = "", err, "", -1, nil, nil
			if d.cfg.Mode == ModeAuto && d.canUDP(&p.Peer) {
				// auto falls back to udp; the peer was sent vxlan, so
				// it may be sent plaintext.
				p.mode, p.err, p.why, p.tunIdx = ModeUDP, nil, "vxlan: "+err.Error(), idxUDP
			}
		}
		for name, p := range s.peers {
			if p.vxlan == nil || d.prober == nil {
				continue
			}
			p.path = "not probed yet"
			if h := d.health[name]; h != nil {
				p.path = h.status()
			}
			if down := d.pathDownLocked(name); down != "" && d.cfg.Mode == ModeAuto && d.canUDP(&p.Peer) {
				// The path does not carry: udp, plaintext as vxlan
				// would have been; the entries stay for the probes.
				p.mode, p.why, p.tunIdx = ModeUDP, "vxlan path "+down, idxUDP
			}
		}
	}
	return s
}

// canUDP reports whether this node can send udp to p: it has the socket
// and the peer accepts udp.
func (d *Device) canUDP(p *Peer) bool {
	return d.binds[idxUDP] != nil && (len(p.Encaps) == 0 || slices.Contains(p.Encaps, ModeUDP))
}

// choosePlain picks the mode towards peer p, whose traffic may be
// plaintext (no password, or trusted: p is in a trusted subnet): with
// auto, the first of this node's modes, fastest first, that the peer has
// too, vxlan only if the peer's VTEP fits this node's (the same port and
// VNI, not this node's MAC or address); otherwise the configured mode.
// why says why that mode: for auto, what allows it, or why vxlan was not
// picked. (Two peers with one VTEP are sorted out after, in buildLocked.)
func (d *Device) choosePlain(p Peer, trusted bool) (mode Mode, why string, err error) {
	allowed := "no password"
	if trusted {
		allowed = "trusted subnet"
	}
	if d.cfg.Mode != ModeAuto {
		mode, err = ChooseMode(d.cfg.Mode, d.local, p.Encaps)
		if err == nil && mode == ModeVXLAN {
			err = vxlanPeerError(*d.vtep, p)
		}
		if err != nil {
			return "", "", err
		}
		return mode, "--encap " + string(mode) + ", " + allowed, nil
	}
	// Why vxlan is not used with this peer, if it is not.
	var novx string
	switch {
	case d.vtep == nil:
		novx = "this node has no vxlan: " + d.noVXLAN
	case !slices.Contains(p.Encaps, ModeVXLAN):
		novx = "the peer has no vxlan"
	default:
		if verr := vxlanPeerError(*d.vtep, p); verr != nil {
			novx = "vxlan: " + verr.Error()
		}
	}
	local := d.local
	if novx != "" {
		local = slices.DeleteFunc(slices.Clone(local), func(m Mode) bool { return m == ModeVXLAN })
	}
	mode, err = ChooseMode(ModeAuto, local, p.Encaps)
	switch {
	case err != nil:
		if novx != "" {
			err = fmt.Errorf("%w (%s)", err, novx)
		}
		return "", "", err
	case mode == ModeVXLAN || mode == ModeIPIP && d.kernel || novx == "":
		return mode, allowed, nil
	}
	return mode, novx, nil
}

// sealedWhy is why a peer that must be encrypted gets the mode it got.
func (d *Device) sealedWhy() string {
	if d.cfg.Mode != ModeAuto {
		return "--encap " + string(d.cfg.Mode) + ", encrypted"
	}
	return "encrypted: outside trusted subnets"
}

// checkEvery is how often SetRing reads the kernel back at the latest,
// even when the ring changes on every call (a big cluster in motion).
const checkEvery = 30 * time.Second

// SetRing hands the tunnel the ring as it is now: the ranges and their
// owners (this peer's among them) and the bridge address, the source of
// the routes. Packets are forwarded by it from now on, and the kernel
// routes of the ranges other peers own are reconciled: added, moved and
// withdrawn (and, on the first call, stale routes from an earlier run
// removed). In the vxlan mode the device's neighbours and FDB entries
// are reconciled too, before the routes via them. The router calls
// SetRing on every ring change and, every 30 s, with the ring it has (its
// resync). A changed ring is applied as a diff against what the last
// apply left (a route or two; reading 3,000 routes and 2,000 neighbour
// and FDB entries back from the kernel costs about 30 ms at 1,000 peers:
// BenchmarkVXLANPeers); the same ring again, or the first, is checked
// against the kernel (and a changed one too if that was last done
// checkEvery ago): what was removed or changed behind weft's back
// (routes, entries, the devices' address) is repaired.
func (d *Device) SetRing(ranges []OwnedRange, src netip.Addr) error {
	t, err := NewTable(ranges)
	if err != nil {
		return fmt.Errorf("tunnel: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	newRanges := t.Ranges()
	now := d.now()
	check := !d.ringOK || src != d.src || slices.Equal(newRanges, d.ranges) || now.Sub(d.checkedAt) >= checkEvery
	if check {
		d.checkedAt = now
	}
	d.ranges, d.src, d.ringOK = newRanges, src, true
	next := *d.snap.Load()
	next.routes = t
	d.snap.Store(&next)
	if d.vtep != nil {
		err = d.applyVTEPsLocked(check)
	}
	if check {
		// The TUN and VXLAN devices' address is checked against the
		// kernel too: one removed by hand comes back.
		d.tunSrc, d.vxSrc = netip.Addr{}, netip.Addr{}
	}
	return errors.Join(err, d.applyRoutesLocked(check))
}

// WantedRoutes is the kernel routes the current ring and peers call for.
func (d *Device) WantedRoutes() []Route {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.wantLocked()
}

func (d *Device) wantLocked() []Route { return d.wantKeeping(nil) }

// wantKeeping is wantLocked, but a peer not heard of yet keeps the route
// on the VXLAN device that kept has for its ranges (see Settle).
func (d *Device) wantKeeping(kept []Route) []Route {
	s := d.snap.Load()
	return WantRoutes(d.ranges, d.cfg.Self, d.src, func(peer string) (string, netip.Addr) {
		p := s.peers[peer]
		switch {
		case p != nil && p.mode == ModeIPIP && d.kernel:
			return d.cfg.IPIPName, p.Underlay
		case p != nil && p.mode == ModeVXLAN:
			return d.cfg.VXLANName, p.VTEP.Addr
		case p == nil && kept != nil:
			if via, ok := keptVia(kept, d.cfg.VXLANName, d.ranges, peer); ok {
				return d.cfg.VXLANName, via
			}
		}
		return d.tun.Name(), netip.Addr{}
	})
}

// routeLister is a RouteApplier that can list what the kernel has.
type routeLister interface {
	Routes() ([]Route, error)
}

// routeDiffer is a RouteApplier that can apply a diff without reading
// the kernel's routes first (NetlinkRoutes.ApplyDiff).
type routeDiffer interface {
	ApplyDiff(add, del []Route) (added, removed []Route, err error)
}

// applyRoutesLocked makes the kernel's tunnel routes those the ring and
// the peers want. Unless check (or while held, or after a failed apply),
// an applier that can applies only the difference from what its last
// apply left; else it reads the kernel's routes and repairs them.
func (d *Device) applyRoutesLocked(check bool) error {
	if d.routing == nil {
		return nil
	}
	var kept []Route
	if d.held && d.vtep != nil {
		if l, ok := d.routing.(routeLister); ok {
			have, err := l.Routes()
			if err != nil {
				return fmt.Errorf("reconciling tunnel routes: %w", err)
			}
			kept = []Route{}
			for _, r := range have {
				if r.Dev == d.cfg.VXLANName {
					kept = append(kept, r)
				}
			}
		}
	}
	want := d.wantKeeping(kept)
	var added, removed []Route
	var err error
	if df, ok := d.routing.(routeDiffer); ok && !check && !d.held && d.routesOK {
		if err = checkWant(want); err == nil {
			add, del := DiffRoutes(want, d.routesDone)
			added, removed, err = df.ApplyDiff(add, del)
		}
	} else {
		added, removed, err = d.routing.Apply(want)
	}
	d.routesDone, d.routesOK = want, err == nil
	logChanges(d.log, "route", "route", added, removed)
	if err != nil {
		return fmt.Errorf("reconciling tunnel routes: %w", err)
	}
	// The TUN device, and the VXLAN device where there is one: a
	// masquerade through a device without the bridge address would take
	// the underlay address, a source outside the pod range that the peer
	// drops (spoofed-source, vxlan-spoofed-source).
	s, ok := d.routing.(sourceSetter)
	if !ok || !d.src.IsValid() {
		return nil
	}
	for _, dev := range []struct {
		name string
		on   bool
		last *netip.Addr
	}{
		{d.tun.Name(), true, &d.tunSrc},
		{d.cfg.VXLANName, d.vtep != nil, &d.vxSrc},
	} {
		if !dev.on || *dev.last == d.src {
			continue
		}
		changed, err := s.SetSourceAddr(dev.name, d.src)
		if err != nil {
			return fmt.Errorf("tunnel: %w", err)
		}
		*dev.last = d.src
		if changed {
			d.log.Info("tunnel device has the bridge address", "device", dev.name, "address", d.src.String())
		}
	}
	return nil
}

// sourceSetter is a RouteApplier that can give the TUN and VXLAN devices
// the bridge address (NetlinkRoutes.SetSourceAddr).
type sourceSetter interface {
	SetSourceAddr(dev string, addr netip.Addr) (changed bool, err error)
}

// vtepDiffer is a VTEPApplier that can apply a diff without reading the
// device's entries first (NetlinkVTEPs.ApplyDiff).
type vtepDiffer interface {
	ApplyDiff(add, del []VTEPEntry) (added, removed []VTEPEntry, err error)
}

// logChanges logs what an apply changed: each change while there are few
// (an operator reads which route moved), a count and the first few when
// there are many (a router starting into 1,000 peers adds 3,000 routes).
func logChanges[T fmt.Stringer](log *slog.Logger, what, key string, added, removed []T) {
	const each = 16
	for _, l := range []struct {
		verb string
		xs   []T
	}{{"added", added}, {"removed", removed}} {
		if len(l.xs) <= each {
			for _, x := range l.xs {
				log.Info(what+" "+l.verb, key, x.String())
			}
			continue
		}
		first := make([]string, 0, 3)
		for _, x := range l.xs[:3] {
			first = append(first, x.String())
		}
		log.Info(fmt.Sprintf("%d %ss %s", len(l.xs), what, l.verb), "count", len(l.xs), "first", strings.Join(first, "; "))
	}
}

// applyVTEPsLocked makes the VXLAN device's neighbours and FDB entries
// those of the peers sent to with vxlan (while held, it only adds).
// Unless check, it does nothing when they are the entries it applied
// last: SetPeers runs on every mesh event, and reading the device's
// neighbours and FDB back each time is work for nothing; the resync
// (SetRing, Settle) checks, and repairs what changed behind weft's back.
func (d *Device) applyVTEPsLocked(check bool) error {
	if d.vteps == nil {
		return nil
	}
	want, _ := vtepEntries(d.snap.Load().peers)
	if !check && d.vtepsOK && slices.Equal(want, d.vtepsDone) {
		return nil
	}
	var added, removed []VTEPEntry
	var err error
	if df, ok := d.vteps.(vtepDiffer); ok && !check && !d.held && d.vtepsOK {
		if err = checkVTEPs(want); err == nil {
			add, del := DiffVTEPs(want, d.vtepsDone)
			added, removed, err = df.ApplyDiff(add, del)
		}
	} else {
		added, removed, err = d.vteps.Apply(want, d.held)
	}
	d.vtepsOK = false
	logChanges(d.log, "vxlan entry", "entry", added, removed)
	if err != nil {
		return fmt.Errorf("reconciling the vxlan entries: %w", err)
	}
	d.vtepsDone, d.vtepsOK = want, true
	return nil
}

// addr is where the peer's traffic goes, for status and the log.
func (p *peerPath) addr() netip.AddrPort {
	if p.mode == ModeVXLAN && p.VTEP != nil {
		return netip.AddrPortFrom(p.Underlay, p.VTEP.Port)
	}
	return p.dst[modeIndex(p.mode)]
}

func sameVTEP(a, b *VTEP) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// Run moves packets until ctx ends or a device or socket fails, then
// closes the Device. It returns nil when ctx ended or Close was called.
func (d *Device) Run(ctx context.Context) error {
	if !d.running.CompareAndSwap(false, true) {
		return errors.New("tunnel: Run called twice")
	}
	select {
	case <-d.closed:
		return nil
	default:
	}
	var wg sync.WaitGroup
	errc := make(chan error, 1+len(d.tun.Queues())+numWireModes)
	queues := d.tun.Queues()
	for _, q := range queues {
		wg.Go(func() { errc <- d.routineReadTUN(q) })
	}
	r := 0
	for i, b := range d.binds {
		if b == nil {
			continue
		}
		q := queues[r%len(queues)]
		r++
		wg.Go(func() { errc <- d.routineRecv(i, b, q) })
	}
	if d.prober != nil && d.vtep != nil {
		pctx, stop := context.WithCancel(ctx)
		defer stop()
		wg.Go(func() {
			if err := d.prober.Run(d.pathAnswered, d.pathChecksum); err != nil {
				if err := d.endErr("vxlan path probes", err); err != nil {
					// The data plane goes on without probes.
					d.log.Warn("the vxlan path probes stopped; paths are no longer checked", "err", err)
				}
			}
		})
		wg.Go(func() { d.routineProbe(pctx) })
	}
	var err error
	select {
	case <-ctx.Done():
	case <-d.closed:
	case err = <-errc:
	}
	cerr := d.Close()
	wg.Wait()
	if err != nil {
		return err
	}
	return cerr
}

// Close closes the TUN device and the sockets, which ends the goroutines
// of Run, then the route applier, and unregisters the metrics. It is safe
// to call more than once.
func (d *Device) Close() error {
	d.closeOnce.Do(func() {
		close(d.closed)
		var errs []error
		if d.tun != nil {
			errs = append(errs, d.tun.Close())
		}
		for _, b := range d.binds {
			if b != nil {
				errs = append(errs, b.Close())
			}
		}
		if d.routing != nil {
			errs = append(errs, d.routing.Close())
		}
		if d.vteps != nil {
			errs = append(errs, d.vteps.Close())
		}
		if d.prober != nil {
			errs = append(errs, d.prober.Close())
		}
		if d.cfg.Registerer != nil {
			d.metrics.unregister(d.cfg.Registerer)
		}
		d.closeErr = errors.Join(errs...)
	})
	return d.closeErr
}

// isClosed maps the errors of a closed device or socket to nil: the end of
// a routine that Close asked for.
func (d *Device) endErr(what string, err error) error {
	select {
	case <-d.closed:
		return nil
	default:
	}
	if errors.Is(err, tun.ErrClosed) || errors.Is(err, conn.ErrClosed) {
		return nil
	}
	return fmt.Errorf("tunnel %s: %w", what, err)
}
