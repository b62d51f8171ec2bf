package tunnel

// Encryption of udp frames: the Device's side of tunnel/crypt. See
// docs/security.md for the design.

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/weft-net/weft/tunnel/crypt"
)

// ErrIPIPUnencrypted is why ipip is refused with a password set for a peer
// outside the trusted subnets.
var ErrIPIPUnencrypted = errors.New("ipip cannot be encrypted: with a password set, use --encap udp, or list the peers' subnets in --trusted-subnets")

// maxParkedSessions bounds the sessions kept for peers that left the peer
// list (so that one coming back keeps its keys, counters and replay
// windows). Beyond it the longest gone are forgotten; one that comes back
// after that gets a new session, whose epochs are new all the same.
const maxParkedSessions = 256

// peerSession is the session with one peer's public key.
type peerSession struct {
	pub       crypt.PublicKey
	sess      *crypt.Session
	goneSince time.Time // when the peer left the peer list; zero while present
}

// ParseTrustedSubnets parses --trusted-subnets: comma-separated IPv4 CIDRs
// of the underlay, e.g. "10.0.0.0/16,192.168.1.0/24". Empty gives none.
func ParseTrustedSubnets(s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		p, err := netip.ParsePrefix(f)
		if err != nil {
			return nil, fmt.Errorf("--trusted-subnets entry %q: give an IPv4 CIDR such as 10.0.0.0/16", f)
		}
		if !p.Addr().Is4() {
			return nil, fmt.Errorf("--trusted-subnets entry %q: weft's underlay is IPv4: give an IPv4 CIDR", f)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// setupCrypto checks the encryption settings of d.cfg and sets the
// Device's crypto state up.
func (d *Device) setupCrypto() error {
	cfg := d.cfg
	for _, p := range cfg.TrustedSubnets {
		if !p.IsValid() || !p.Addr().Is4() {
			return fmt.Errorf("trusted subnet %v: give IPv4 CIDRs (weft's underlay is IPv4)", p)
		}
		d.trusted = append(d.trusted, p.Masked())
	}
	d.ipipOK = true
	if cfg.PSK == nil {
		return nil
	}
	if len(cfg.PSK) != crypt.KeySize {
		return fmt.Errorf("tunnel: PSK of %d bytes, want %d (from crypt.DeriveKeys)", len(cfg.PSK), crypt.KeySize)
	}
	kp := cfg.KeyPair
	if kp == nil {
		var err error
		if kp, err = crypt.GenerateKeyPair(); err != nil {
			return err
		}
	}
	d.crypto = crypt.NewLocal(kp, [crypt.KeySize]byte(cfg.PSK), cfg.Rekey)
	d.ipipOK = len(d.trusted) > 0
	if cfg.Mode == ModeIPIP && !d.ipipOK {
		return ErrIPIPUnencrypted
	}
	if cfg.Mode == ModeVXLAN && !d.ipipOK {
		return ErrVXLANUnencrypted
	}
	return nil
}

// Encryption is the data plane's encryption, for status.
type Encryption struct {
	Enabled bool `json:"enabled"`
	// AEAD seals the frames (crypt.AEADName).
	AEAD string `json:"aead,omitempty"`
	// PublicKey is this node's public key, base64.
	PublicKey string `json:"publicKey,omitempty"`
	// TrustedSubnets get plaintext.
	TrustedSubnets []netip.Prefix `json:"trustedSubnets,omitempty"`
}

// String is "enabled" or "disabled", for the status line
// "Encryption: enabled".
func (e Encryption) String() string {
	if e.Enabled {
		return "enabled"
	}
	return "disabled"
}

// Encryption describes the data plane's encryption.
func (d *Device) Encryption() Encryption {
	if d.crypto == nil {
		return Encryption{}
	}
	return Encryption{Enabled: true, AEAD: crypt.AEADName, PublicKey: d.crypto.Public().String(), TrustedSubnets: slices.Clone(d.trusted)}
}

// PublicKey is what this node publishes in its mesh metadata
// (mesh.Config.PublicKey): its public key, or nil without encryption.
func (d *Device) PublicKey() []byte {
	if d.crypto == nil {
		return nil
	}
	k := d.crypto.Public()
	return k[:]
}

func prefixList(ps []netip.Prefix) string {
	if len(ps) == 0 {
		return "none"
	}
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

// securePathLocked fills in how pp is protected: plaintext or sealed, and
// its session keys (made, or kept from before). The error says why a peer
// that must encrypt has no session.
func (d *Device) securePathLocked(pp *peerPath) error {
	if d.crypto == nil {
		pp.plain = true
		return nil
	}
	pp.trusted = slices.ContainsFunc(d.trusted, func(p netip.Prefix) bool { return p.Contains(pp.Underlay) })
	pp.plain = pp.trusted
	if len(pp.PublicKey) == 0 {
		return fmt.Errorf("peer %s publishes no public key: it runs without a password (or an older weft); give it the same --password-file", pp.Name)
	}
	pub, err := crypt.ParsePublicKey(pp.PublicKey)
	if err != nil {
		return fmt.Errorf("peer %s: %w", pp.Name, err)
	}
	e := d.sessions[pp.Name]
	if e == nil || e.pub != pub {
		sess, err := d.crypto.Session(pub)
		if err != nil {
			return fmt.Errorf("peer %s: %w", pp.Name, err)
		}
		e = &peerSession{pub: pub, sess: sess}
		d.sessions[pp.Name] = e
	}
	e.goneSince = time.Time{}
	pp.sess = e.sess
	return nil
}

// parkSessionsLocked marks the sessions of peers no longer present as
// gone and forgets the longest gone beyond maxParkedSessions.
func (d *Device) parkSessionsLocked(present map[string]bool) {
	now := d.now()
	var parked []string
	for name, e := range d.sessions {
		if present[name] {
			continue
		}
		if e.goneSince.IsZero() {
			e.goneSince = now
		}
		parked = append(parked, name)
	}
	if len(parked) <= maxParkedSessions {
		return
	}
	slices.SortFunc(parked, func(a, b string) int { return d.sessions[a].goneSince.Compare(d.sessions[b].goneSince) })
	for _, name := range parked[:len(parked)-maxParkedSessions] {
		delete(d.sessions, name)
	}
}

// chooseSealedMode is ChooseMode for a peer whose traffic must be
// encrypted: ipip is out.
func chooseSealedMode(configured Mode, local, remote []Mode) (Mode, error) {
	switch configured {
	case ModeIPIP:
		return "", ErrIPIPUnencrypted
	case ModeVXLAN:
		return "", ErrVXLANUnencrypted
	}
	m, err := ChooseMode(configured, slices.DeleteFunc(slices.Clone(local), func(m Mode) bool { return m == ModeIPIP || m == ModeVXLAN }), remote)
	if err != nil && slices.Contains(remote, ModeIPIP) {
		err = fmt.Errorf("%w (ipip is not used with a password: it cannot be encrypted)", err)
	}
	return m, err
}

// protection says how a peer's traffic travels, for the log.
func (p *peerPath) protection() string {
	switch {
	case p.trusted:
		return "unencrypted (trusted subnet)"
	case p.plain:
		return "unencrypted"
	}
	return "encrypted"
}

// openFrame checks a udp frame from peer p and returns its header and
// inner packet. A sealed frame is opened in place with p's session (enc:
// encryption is on here); a plaintext one is accepted only from a peer
// that may send plaintext. It never panics and allocates nothing.
func openFrame(b []byte, p *peerPath, enc bool, sc *crypt.Scratch, now time.Time) (FrameHeader, []byte, dropReason) {
	h, r := decodeAnyHeader(b)
	if r != dropNone {
		return h, nil, r
	}
	payload := b[FrameHeaderLen:]
	switch {
	case h.encrypted():
		switch {
		case !enc:
			return h, nil, dropEncrypted
		case h.Flags&FlagEncrypted == 0 || h.KeyID == 0:
			return h, nil, dropAuth // a sealed frame has both
		case p.sess == nil:
			return h, nil, dropNoKey
		}
		pt, err := p.sess.Open(sc, h.KeyID, h.Counter, b[:FrameHeaderLen], payload, now)
		switch {
		case errors.Is(err, crypt.ErrReplay):
			return h, nil, dropReplay
		case errors.Is(err, crypt.ErrKeyBudget):
			return h, nil, dropKeyBudget
		case err != nil:
			return h, nil, dropAuth
		}
		payload = pt
	case !p.plain:
		return h, nil, dropPlaintext
	}
	inner, r := ipv4Check(payload)
	return h, inner, r
}

// sealFrame seals the frame in place for peer p: frame is the header
// space followed by the inner packet, with room for the tag after it. It
// returns the sealed frame.
func sealFrame(frame []byte, flags FrameFlags, p *peerPath, sc *crypt.Scratch, now time.Time) ([]byte, dropReason) {
	k, c, err := p.sess.Next(now)
	if err != nil {
		return nil, dropNoKey
	}
	PutFrameHeader(frame, FrameHeader{Version: FrameVersion, Type: FrameData, Flags: flags | FlagEncrypted, KeyID: k.Epoch(), Counter: c})
	sealed := k.Seal(sc, c, frame[:FrameHeaderLen], frame[FrameHeaderLen:])
	return frame[:FrameHeaderLen+len(sealed)], dropNone
}

// dropWarnings rate-limits the warnings about dropped frames that an
// operator should hear of: at most one per reason a minute, with the
// count since the last one.
type dropWarnings struct {
	mu   sync.Mutex
	last [numDropReasons]time.Time
	held [numDropReasons]uint64
}

// warned are the reasons warned about, and what the warning says.
var warned = map[dropReason]string{
	dropAuth:        "encrypted frames failed authentication: a peer with another password, or forged traffic",
	dropReplay:      "encrypted frames were replays or too old",
	dropPlaintext:   "plaintext frames came from a peer outside --trusted-subnets, which must encrypt: does it run without a password?",
	dropNoKey:       "encrypted frames came from a peer whose public key this node does not have (yet)",
	dropUnknownPeer: "frames came from an underlay address that is no known peer: forged traffic, or a peer this node has not heard of yet",
	dropSpoofed:     "decapsulated packets had an inner source outside the ranges of the peer that sent them: a pod or host forging addresses, or a ring not yet in step",
	dropKeyBudget:   "encrypted frames of new key ids came faster than a peer rekeys: forged traffic (they were dropped unopened)",
}

// warnedReasons are the keys of warned, for the packet path.
var warnedReasons = []dropReason{dropAuth, dropReplay, dropPlaintext, dropNoKey, dropUnknownPeer, dropSpoofed, dropKeyBudget}

// warnable reports whether the tally holds drops that are warned about.
func (t *tally) warnable() bool {
	for _, r := range warnedReasons {
		if t.drop[r] != 0 {
			return true
		}
	}
	return false
}

// warnDrops logs the warned-about drops of a batch, rate-limited; from
// holds the source of the last of each.
func (d *Device) warnDrops(t *tally, from *[numDropReasons]netip.Addr, now time.Time) {
	for _, r := range warnedReasons {
		msg, n := warned[r], t.drop[r]
		if n == 0 {
			continue
		}
		d.warns.mu.Lock()
		d.warns.held[r] += n
		held, ok := d.warns.held[r], d.warns.last[r].IsZero() || now.Sub(d.warns.last[r]) >= time.Minute
		if ok {
			d.warns.held[r], d.warns.last[r] = 0, now
		}
		d.warns.mu.Unlock()
		if ok {
			d.log.Warn(fmt.Sprintf("%d %s", held, msg), "reason", dropReasonNames[r], "last-from", from[r], "count", held)
		}
	}
}
