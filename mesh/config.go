package mesh

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
)

// DefaultPort is the gossip port (TCP and UDP) when --port is not given, and
// the port assumed for a --peers entry that names none.
const DefaultPort = 6783

// Limits on what a peer publishes about itself.
const (
	MaxNameLen     = 64 // bytes of a peer name (the router's --name limit)
	MaxNicknameLen = 63 // bytes of a nickname (a host name label)
	MaxVersionLen  = 64 // bytes of the version string
)

// PeerName is a peer's stable name: its memberlist node name.
type PeerName string

// Config configures a Mesh. Name is required; everything else has a default.
type Config struct {
	// Name is this peer's name (the router's persisted or --name value).
	Name PeerName
	// Nickname is a human name, usually the host name (--nickname).
	Nickname string

	// BindAddr is the address the gossip port listens on: the underlay
	// --host. Empty listens on every address.
	BindAddr string
	// AdvertiseAddr is the address other peers reach us at. Empty means
	// BindAddr, or memberlist's pick of a private address when BindAddr
	// is empty.
	AdvertiseAddr string
	// Port is the gossip port, TCP and UDP (--port, DefaultPort in the
	// router). 0 picks a free port: for tests.
	Port int
	// Components are the blobs other components publish in this peer's
	// metadata (the router's "tunnel": data port, encapsulations, public
	// key), and how peers' blobs of them are checked. The mesh never
	// reads them; see Component.
	Components []Component
	// SecretKey is the gossip key derived from the password
	// (crypt.DeriveKeys: Keys.Gossip, 32 bytes). When set, memberlist
	// encrypts and authenticates every gossip packet and stream with it
	// (AES-256-GCM) and refuses anything it cannot open, so a peer with
	// no or another password cannot join; the attempts are logged (one
	// line per address a minute) and counted
	// (weft_mesh_auth_failures_total). Nil: gossip in the clear.
	SecretKey []byte
	// Version is this build's version; published in the metadata.
	Version string

	// Peers are the --peers entries: host[:port], by name or address.
	// Each is resolved again on every attempt.
	Peers []string
	// Remembered are the peers saved from the last run (see KnownPeers);
	// they are joined like Peers.
	Remembered []string

	// Logger receives every log line, memberlist's own included.
	Logger *slog.Logger
	// Registerer receives the mesh's metrics; nil registers nothing.
	Registerer prometheus.Registerer
	// Timings tune memberlist and the join loop; zero fields take the
	// defaults of DefaultTimings.
	Timings Timings

	// PreAuth bounds what the gossip port spends on packets and streams
	// before they are authenticated (see PreAuthLimits); zero fields
	// take the defaults.
	PreAuth PreAuthLimits

	// NoCompression turns off memberlist's LZW compression of what this
	// peer sends (every gossip packet it makes smaller, and every
	// stream). Compression is on in a router: idle, it sends a quarter
	// to a third of the bytes (100 peers: 842-985 against 2,372-4,035
	// bytes a second a peer; a push-pull of 2.9 KB against 11 KB) for
	// about 40 % more CPU (0.22-0.25 against 0.16-0.17 % of a core a
	// peer; docs/benchmarks.md, Scale).
	// The scale harness turns it off to fit more peers on 2 cores. A
	// peer decodes a compressed message whatever this says, so peers
	// that differ here still understand each other.
	NoCompression bool

	// Transport replaces the UDP/TCP transport on BindAddr:Port, e.g. with
	// meshtest's in-memory network. Nil for production.
	Transport memberlist.NodeAwareTransport
}

// Timings are memberlist's timers plus the join loop's. DefaultTimings
// documents the choice for a LAN cluster of up to about 1000 peers.
type Timings struct {
	GossipInterval      time.Duration // how often a peer sends queued broadcasts
	GossipNodes         int           // to how many random peers per gossip round (the fanout)
	RetransmitMult      int           // each broadcast is sent RetransmitMult*ceil(log10(N+1)) times
	ProbeInterval       time.Duration // how often a peer probes one other peer
	ProbeTimeout        time.Duration // how long a probe waits for its ack
	SuspicionMult       int           // a suspect is declared dead after SuspicionMult*max(1,log10(N))*ProbeInterval
	PushPullInterval    time.Duration // full state exchange with one random peer (scaled up by memberlist above 32 peers)
	GossipToTheDeadTime time.Duration // dead peers still get gossip (and are forgotten by memberlist) after this
	DeadNodeReclaimTime time.Duration // a dead peer's name may come back from a new address after this
	TCPTimeout          time.Duration // stream (push-pull, join, reliable send) timeout
	JoinBackoffMin      time.Duration // first retry of an initial join that reached nobody
	JoinBackoffMax      time.Duration // cap of the exponential backoff
	ReconnectInterval   time.Duration // once joined: how often unreached targets and unreachable peers are retried
	LeaveTimeout        time.Duration // how long Close waits for the leave to be gossiped
	PeerRetention       time.Duration // unreachable and left peers are dropped from the view after this
}

// DefaultTimings returns the production timings. They are memberlist's
// DefaultLANConfig, which is sized for thousands of nodes on a LAN, with
// more retransmissions and a shorter TCP timeout; see the package
// documentation for the reasoning and the expected convergence.
func DefaultTimings() Timings {
	lan := memberlist.DefaultLANConfig()
	return Timings{
		GossipInterval:      lan.GossipInterval,      // 200ms
		GossipNodes:         lan.GossipNodes,         // 3
		RetransmitMult:      6,                       // memberlist: 4
		ProbeInterval:       lan.ProbeInterval,       // 1s
		ProbeTimeout:        lan.ProbeTimeout,        // 500ms
		SuspicionMult:       lan.SuspicionMult,       // 4
		PushPullInterval:    lan.PushPullInterval,    // 30s
		GossipToTheDeadTime: lan.GossipToTheDeadTime, // 30s
		DeadNodeReclaimTime: 30 * time.Second,
		TCPTimeout:          5 * time.Second,
		JoinBackoffMin:      time.Second,
		JoinBackoffMax:      30 * time.Second,
		ReconnectInterval:   10 * time.Second,
		LeaveTimeout:        3 * time.Second,
		PeerRetention:       24 * time.Hour,
	}
}

// withDefaults fills zero fields from DefaultTimings.
func (t Timings) withDefaults() Timings {
	d := DefaultTimings()
	setD := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	setI := func(v *int, def int) {
		if *v <= 0 {
			*v = def
		}
	}
	setD(&t.GossipInterval, d.GossipInterval)
	setI(&t.GossipNodes, d.GossipNodes)
	setI(&t.RetransmitMult, d.RetransmitMult)
	setD(&t.ProbeInterval, d.ProbeInterval)
	setD(&t.ProbeTimeout, d.ProbeTimeout)
	setI(&t.SuspicionMult, d.SuspicionMult)
	setD(&t.PushPullInterval, d.PushPullInterval)
	setD(&t.GossipToTheDeadTime, d.GossipToTheDeadTime)
	setD(&t.DeadNodeReclaimTime, d.DeadNodeReclaimTime)
	setD(&t.TCPTimeout, d.TCPTimeout)
	setD(&t.JoinBackoffMin, d.JoinBackoffMin)
	setD(&t.JoinBackoffMax, d.JoinBackoffMax)
	setD(&t.ReconnectInterval, d.ReconnectInterval)
	setD(&t.LeaveTimeout, d.LeaveTimeout)
	setD(&t.PeerRetention, d.PeerRetention)
	if t.JoinBackoffMax < t.JoinBackoffMin {
		t.JoinBackoffMax = t.JoinBackoffMin
	}
	return t
}

// ValidateName checks a peer name: 1 to MaxNameLen bytes of printable ASCII
// without spaces, commas or parentheses (they delimit names in status text).
func ValidateName(n PeerName) error {
	if n == "" || len(n) > MaxNameLen {
		return fmt.Errorf("peer name %q: give 1 to %d characters", n, MaxNameLen)
	}
	for _, r := range n {
		if r <= ' ' || r > '~' || r == '(' || r == ')' || r == ',' {
			return fmt.Errorf("peer name %q: only printable ASCII without spaces, commas or parentheses", n)
		}
	}
	return nil
}

// validate checks cfg and returns it with defaults filled in.
func (cfg Config) validate() (Config, error) {
	var errs []error
	if err := ValidateName(cfg.Name); err != nil {
		errs = append(errs, err)
	}
	if cfg.Port < 0 || cfg.Port > 65535 {
		errs = append(errs, fmt.Errorf("gossip port %d (--port): give a port between 1 and 65535", cfg.Port))
	}
	switch len(cfg.SecretKey) {
	case 0, 16, 24, 32:
	default:
		errs = append(errs, fmt.Errorf("gossip secret key of %d bytes: want 32 (crypt.DeriveKeys)", len(cfg.SecretKey)))
	}
	for _, a := range []struct{ flag, v string }{{"bind address (--host)", cfg.BindAddr}, {"advertise address (--host)", cfg.AdvertiseAddr}} {
		if a.v != "" {
			if _, err := netip.ParseAddr(a.v); err != nil {
				errs = append(errs, fmt.Errorf("%s %q: give an IP address", a.flag, a.v))
			}
		}
	}
	var peers []string
	for _, p := range cfg.Peers {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if _, _, err := splitTarget(p, DefaultPort); err != nil {
			errs = append(errs, fmt.Errorf("--peers entry %q: %w", p, err))
			continue
		}
		peers = append(peers, p)
	}
	cfg.Peers = peers
	if len(errs) > 0 {
		return cfg, errors.Join(errs...)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg.Timings = cfg.Timings.withDefaults()
	return cfg, nil
}
