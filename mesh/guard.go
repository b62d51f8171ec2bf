package mesh

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

// PreAuthLimits bound what the gossip port spends on a packet or stream
// before it knows that the sender has the password. memberlist alone
// buffers whatever length an incoming encrypted stream announces (up to
// 20 MB) before it can try to decrypt it, so twenty connections from
// anyone who reaches the port could take 400 MB. Zero fields take the
// defaults of DefaultPreAuthLimits.
type PreAuthLimits struct {
	// MaxStreamSize is the largest message an incoming stream may carry
	// (one push-pull, join or SendTo), ciphertext included. A stream
	// that announces more is closed after its first 5 bytes.
	MaxStreamSize int
	// Budget is the bytes held at once for incoming streams that are not
	// authenticated yet, all together. A stream that would overflow it is
	// closed before anything is read into memory.
	Budget int
	// MaxStreams is the number of incoming streams not authenticated yet
	// at once; MaxStreamsPerSource the number from one address.
	MaxStreams          int
	MaxStreamsPerSource int
	// Timeout is how long an incoming stream has to deliver its message.
	Timeout time.Duration
}

// DefaultPreAuthLimits returns the production limits. A push-pull of
// 1000 peers is about 150 KB of memberlist state plus weft's channels
// (the ring and the topology reports, well under 1 MB), so 4 MiB leaves
// room; the budget admits four streams of that size at once and any
// number of the usual few-KB ones.
func DefaultPreAuthLimits() PreAuthLimits {
	return PreAuthLimits{
		MaxStreamSize:       4 << 20,
		Budget:              16 << 20,
		MaxStreams:          64,
		MaxStreamsPerSource: 4,
		Timeout:             5 * time.Second,
	}
}

func (l PreAuthLimits) withDefaults(tcpTimeout time.Duration) PreAuthLimits {
	d := DefaultPreAuthLimits()
	if tcpTimeout > 0 {
		d.Timeout = tcpTimeout
	}
	if l.MaxStreamSize <= 0 {
		l.MaxStreamSize = d.MaxStreamSize
	}
	if l.Budget <= 0 {
		l.Budget = d.Budget
	}
	if l.Budget < l.MaxStreamSize {
		l.Budget = l.MaxStreamSize
	}
	if l.MaxStreams <= 0 {
		l.MaxStreams = d.MaxStreams
	}
	if l.MaxStreamsPerSource <= 0 {
		l.MaxStreamsPerSource = d.MaxStreamsPerSource
	}
	if l.Timeout <= 0 {
		l.Timeout = d.Timeout
	}
	return l
}

// Why the guard refused a packet or stream: the values of the
// weft_mesh_preauth_refused_total label.
const (
	refusedLabel     = "label"      // a memberlist label header: weft uses none
	refusedEmpty     = "empty"      // an empty packet or a stream closed before its first byte
	refusedPlain     = "plaintext"  // not encrypted while this peer has a password
	refusedAuth      = "auth"       // did not decrypt with the key
	refusedTooLarge  = "too-large"  // announced more than MaxStreamSize
	refusedBusy      = "busy"       // MaxStreams, MaxStreamsPerSource or Budget reached
	refusedTruncated = "truncated"  // ended or timed out before the announced length
	refusedOverLimit = "over-limit" // a plaintext stream read past MaxStreamSize
)

var refusedReasons = []string{refusedLabel, refusedEmpty, refusedPlain, refusedAuth, refusedTooLarge, refusedBusy, refusedTruncated, refusedOverLimit}

// memberlist's wire bytes (net.go and security.go of v0.7.0; the values
// are part of its protocol and only ever appended to).
const (
	mlEncryptMsg  = 10  // encryptMsg: a stream's encrypted message follows
	mlHasLabelMsg = 244 // hasLabelMsg: a label header
	mlMaxVsn      = 1   // encryption versions 0 (padded) and 1
	mlNonceSize   = 12
	mlTagSize     = 16
	mlMinSealed   = 1 + mlNonceSize + mlTagSize
)

// guard wraps memberlist's transport: before a packet or incoming stream
// reaches memberlist it is checked against the password and the limits,
// so that memberlist never buffers or logs for someone without the key.
//
// With a key, a packet must decrypt with it (memberlist then decrypts it
// again: two AES-GCM opens of at most 1.4 KB); an incoming stream must
// announce at most MaxStreamSize, fit in the budget, arrive within
// Timeout and decrypt; only then is it handed to memberlist, replaying
// the verified bytes. Without a key nothing can be authenticated: a
// stream holds a slot for as long as memberlist reads it and may deliver
// at most MaxStreamSize bytes. Label headers are refused either way.
//
// Every refusal is counted by reason; an authentication failure also goes
// to authFailures (one warning per source a minute, bounded); the rest is
// logged at debug and summarised at most once a minute per reason at
// info. Per-source state lives only while a stream from that source is
// open, so it is bounded by MaxStreams.
type guard struct {
	memberlist.NodeAwareTransport
	aead   cipher.AEAD // nil: no password
	lim    PreAuthLimits
	refuse func(reason string, from netip.Addr, err error)
	authFn func(addr string)
	now    func() time.Time

	packetCh chan *memberlist.Packet
	streamCh chan net.Conn
	done     chan struct{} // closed by Shutdown: stop handing over
	drained  chan struct{} // closed once the inner transport is shut down
	wg       sync.WaitGroup
	once     sync.Once

	scratch []byte // routinePackets' buffer for opening a packet
	answer  []byte // sent back on a stream that failed authentication

	mu       sync.Mutex // guards the fields below
	streams  int
	held     int                // bytes reserved in the budget
	perSrc   map[netip.Addr]int // open pre-auth streams by source; entries at 0 are deleted
	open     map[net.Conn]struct{}
	shutdown bool
}

// newGuard wraps inner; key is the gossip key (nil: no password). The
// guard starts reading the inner channels at once.
func newGuard(inner memberlist.NodeAwareTransport, key []byte, lim PreAuthLimits, refuse func(string, netip.Addr, error), auth func(string)) (*guard, error) {
	g := &guard{
		NodeAwareTransport: inner,
		lim:                lim,
		refuse:             refuse,
		authFn:             auth,
		now:                time.Now,
		packetCh:           make(chan *memberlist.Packet),
		streamCh:           make(chan net.Conn),
		done:               make(chan struct{}),
		drained:            make(chan struct{}),
		perSrc:             map[netip.Addr]int{},
		open:               map[net.Conn]struct{}{},
	}
	if len(key) > 0 {
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, fmt.Errorf("the gossip key: %w", err)
		}
		if g.aead, err = cipher.NewGCM(block); err != nil {
			return nil, fmt.Errorf("the gossip key: %w", err)
		}
		g.scratch = make([]byte, 0, 64<<10)
		g.answer = sealedAnswer(g.aead)
	}
	g.wg.Add(2)
	go g.routinePackets()
	go g.routineStreams()
	return g, nil
}

// DialTimeout and DialAddressTimeout bound what memberlist reads from a
// stream this peer opened (the answer to a push-pull or a ping) to what
// an incoming stream may carry, so that whoever answers at a peer's
// address cannot make it buffer 20 MB either.
func (g *guard) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	c, err := g.NodeAwareTransport.DialTimeout(addr, timeout)
	return g.limitDialed(c, err)
}

func (g *guard) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	c, err := g.NodeAwareTransport.DialAddressTimeout(a, timeout)
	return g.limitDialed(c, err)
}

func (g *guard) limitDialed(c net.Conn, err error) (net.Conn, error) {
	if err != nil {
		return nil, err
	}
	return &limitConn{Conn: c, left: int64(g.lim.MaxStreamSize) + 64<<10}, nil
}

func (g *guard) PacketCh() <-chan *memberlist.Packet { return g.packetCh }
func (g *guard) StreamCh() <-chan net.Conn           { return g.streamCh }

// Shutdown stops handing packets and streams to memberlist, closes the
// streams still being checked, shuts the inner transport down (draining
// its channels meanwhile) and waits for every goroutine of the guard.
func (g *guard) Shutdown() error {
	var err error
	g.once.Do(func() {
		close(g.done)
		g.mu.Lock()
		g.shutdown = true
		for c := range g.open {
			c.Close()
		}
		g.mu.Unlock()
		err = g.NodeAwareTransport.Shutdown()
		close(g.drained)
		g.wg.Wait()
	})
	return err
}

// routinePackets checks every packet from the inner transport.
func (g *guard) routinePackets() {
	defer g.wg.Done()
	in := g.NodeAwareTransport.PacketCh()
	for {
		var p *memberlist.Packet
		select {
		case p = <-in:
		case <-g.drained:
			return
		}
		if !g.packetOK(p) {
			continue
		}
		select {
		case g.packetCh <- p:
		case <-g.done:
			// Keep draining until the inner transport has stopped.
		}
	}
}

// packetOK says whether a packet may go to memberlist; a refusal is
// counted and reported.
func (g *guard) packetOK(p *memberlist.Packet) bool {
	from := sourceAddr(p.From)
	b := p.Buf
	switch {
	case len(b) == 0:
		g.refuse(refusedEmpty, from, errEmptyPacket)
		return false
	case b[0] == mlHasLabelMsg:
		g.refuse(refusedLabel, from, errLabelPacket)
		return false
	case g.aead == nil:
		return true
	}
	if err := g.open1(b, nil, &g.scratch); err != nil {
		g.refuse(refusedAuth, from, err)
		g.authFn(addrPortString(p.From))
		return false
	}
	return true
}

// open1 checks that sealed ([vsn][nonce][ciphertext+tag], memberlist's
// encryptPayload) opens with the key and aad, into *scratch.
func (g *guard) open1(sealed, aad []byte, scratch *[]byte) error {
	switch {
	case sealed[0] > mlMaxVsn:
		return fmt.Errorf("not encrypted with a password (version byte %d)", sealed[0])
	case len(sealed) < mlMinSealed:
		return fmt.Errorf("%d bytes: too short to be encrypted", len(sealed))
	}
	out, err := g.aead.Open((*scratch)[:0], sealed[1:1+mlNonceSize], sealed[1+mlNonceSize:], aad)
	if cap(out) > cap(*scratch) && cap(out) <= 64<<10 {
		*scratch = out[:0] // grown (a packet over 64 KiB cannot come)
	}
	if err != nil {
		return errNotOurKey
	}
	return nil
}

// The guard's reasons for a packet, made once: a flood of them allocates
// nothing for its errors.
var (
	errEmptyPacket = errors.New("empty packet")
	errLabelPacket = errors.New("packet with a label header (weft uses none)")
	errNotOurKey   = errors.New("does not decrypt with this peer's key")
)

// routineStreams takes every incoming stream and checks it in its own
// goroutine, within the limits.
func (g *guard) routineStreams() {
	defer g.wg.Done()
	in := g.NodeAwareTransport.StreamCh()
	for {
		var c net.Conn
		select {
		case c = <-in:
		case <-g.drained:
			return
		}
		from := sourceAddr(c.RemoteAddr())
		if err := g.admit(c, from); err != nil {
			c.Close()
			g.refuse(refusedBusy, from, err)
			continue
		}
		g.wg.Add(1)
		go g.routineStream(c, from)
	}
}

// admit takes a pre-auth slot for a stream from from.
func (g *guard) admit(c net.Conn, from netip.Addr) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.shutdown:
		return errors.New("shutting down")
	case g.streams >= g.lim.MaxStreams:
		return fmt.Errorf("%d unauthenticated streams open, the limit", g.streams)
	case g.perSrc[from] >= g.lim.MaxStreamsPerSource:
		return fmt.Errorf("%d unauthenticated streams open from %s, the limit per source", g.perSrc[from], from)
	}
	g.streams++
	g.perSrc[from]++
	g.open[c] = struct{}{}
	return nil
}

// release gives back a stream's slot and n reserved bytes.
func (g *guard) release(c net.Conn, from netip.Addr, n int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.streams--
	g.held -= n
	if g.perSrc[from]--; g.perSrc[from] <= 0 {
		delete(g.perSrc, from)
	}
	delete(g.open, c)
}

// reserve takes n bytes of the budget, or says why not.
func (g *guard) reserve(n int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.held+n > g.lim.Budget {
		return fmt.Errorf("%d bytes announced while %d of the %d-byte budget for unauthenticated streams are held", n, g.held, g.lim.Budget)
	}
	g.held += n
	return nil
}

// routineStream checks one incoming stream and hands it to memberlist.
func (g *guard) routineStream(c net.Conn, from netip.Addr) {
	defer g.wg.Done()
	if g.aead == nil {
		// Nothing to authenticate: the slot is held while memberlist
		// reads, and what it may read is bounded.
		lc := &limitConn{Conn: c, left: int64(g.lim.MaxStreamSize)}
		lc.onClose = func() {
			g.release(c, from, 0)
			if lc.over {
				g.refuse(refusedOverLimit, from, fmt.Errorf("plaintext stream longer than %d bytes", g.lim.MaxStreamSize))
			}
		}
		if err := g.peekLabel(lc, from); err != nil {
			lc.Close()
			return
		}
		g.hand(lc)
		return
	}
	conn, reserved, reason, err := g.verifyStream(c)
	if err != nil && (reason == refusedAuth || reason == refusedPlain) {
		// Tell the other side, as memberlist would: its memberlist
		// then logs why ("no installed keys could decrypt", "remote
		// state is encrypted and encryption is not configured").
		c.SetWriteDeadline(g.now().Add(time.Second))
		c.Write(g.answer)
	}
	g.release(c, from, reserved)
	if err != nil {
		c.Close()
		g.refuse(reason, from, err)
		if reason == refusedAuth || reason == refusedPlain {
			g.authFn(from.String())
		}
		return
	}
	g.hand(conn)
}

// hand gives a checked stream to memberlist.
func (g *guard) hand(c net.Conn) {
	select {
	case g.streamCh <- c:
	case <-g.done:
		c.Close()
	}
}

// peekLabel refuses a plaintext stream that starts with a label header.
func (g *guard) peekLabel(lc *limitConn, from netip.Addr) error {
	lc.SetReadDeadline(g.now().Add(g.lim.Timeout))
	var b [1]byte
	n, err := io.ReadFull(lc.Conn, b[:])
	lc.SetReadDeadline(time.Time{})
	if n == 0 {
		g.refuse(refusedEmpty, from, fmt.Errorf("stream without a first byte: %v", err))
		return errors.New("empty")
	}
	if b[0] == mlHasLabelMsg {
		g.refuse(refusedLabel, from, errors.New("stream with a label header (weft uses none)"))
		return errors.New("label")
	}
	lc.pending = b[:]
	lc.left--
	return nil
}

// verifyStream reads an encrypted stream's message ([10][len:4][sealed],
// memberlist's encryptLocalState) within the limits and opens it. On
// success it returns a conn that replays the message; the reservation is
// returned for release either way.
func (g *guard) verifyStream(c net.Conn) (net.Conn, int, string, error) {
	c.SetReadDeadline(g.now().Add(g.lim.Timeout))
	var hdr [5]byte
	n, err := io.ReadFull(c, hdr[:])
	switch {
	case n == 0:
		return nil, 0, refusedEmpty, fmt.Errorf("stream without a first byte: %v", err)
	case hdr[0] == mlHasLabelMsg:
		return nil, 0, refusedLabel, errors.New("stream with a label header (weft uses none)")
	case hdr[0] != mlEncryptMsg:
		return nil, 0, refusedPlain, fmt.Errorf("stream not encrypted (message type %d)", hdr[0])
	case err != nil:
		return nil, 0, refusedTruncated, fmt.Errorf("stream header: %v", err)
	}
	size := binary.BigEndian.Uint32(hdr[1:])
	if size > uint32(g.lim.MaxStreamSize) {
		return nil, 0, refusedTooLarge, fmt.Errorf("stream announces %d bytes, more than the %d allowed", size, g.lim.MaxStreamSize)
	}
	if size < mlMinSealed {
		return nil, 0, refusedAuth, fmt.Errorf("stream announces %d bytes: too short to be encrypted", size)
	}
	if err := g.reserve(int(size)); err != nil {
		return nil, 0, refusedBusy, err
	}
	msg, err := readUpTo(c, int(size))
	if err != nil {
		return nil, int(size), refusedTruncated, fmt.Errorf("stream ended after %d of %d announced bytes: %v", len(msg), size, err)
	}
	if msg[0] > mlMaxVsn {
		return nil, int(size), refusedAuth, fmt.Errorf("not encrypted with a password (version byte %d)", msg[0])
	}
	// Open in place, then seal again in place: AES-GCM is deterministic
	// for a key, nonce and aad, so this restores the exact bytes
	// memberlist will decrypt, without a second buffer of the size.
	nonce := msg[1 : 1+mlNonceSize]
	body := msg[1+mlNonceSize:]
	plain, err := g.aead.Open(body[:0], nonce, body, hdr[:])
	if err != nil {
		return nil, int(size), refusedAuth, errors.New("stream does not decrypt with this peer's key")
	}
	g.aead.Seal(plain[:0], nonce, plain, hdr[:])
	c.SetReadDeadline(time.Time{})
	replay := make([]byte, 0, len(hdr)+len(msg))
	replay = append(append(replay, hdr[:]...), msg...)
	return &replayConn{Conn: c, buf: replay}, int(size), "", nil
}

// sealedAnswer is the stream answer to a peer without the key: memberlist's
// error message ([13] then the msgpack map {"Error": "..."}) sealed as
// memberlist seals a stream. It is the same bytes every time: one fixed
// plaintext under one nonce reveals nothing, and nothing else is ever
// sealed under that nonce.
func sealedAnswer(aead cipher.AEAD) []byte {
	const text = "authentication failed: another or no password"
	plain := append([]byte{13, 0x81, 0xa5}, "Error"...)
	plain = append(append(plain, 0xa0|byte(len(text))), text...)
	size := 1 + mlNonceSize + len(plain) + mlTagSize
	b := []byte{mlEncryptMsg, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], uint32(size))
	hdr := b[:5:5]
	b = append(b, 1) // encryption version 1: no padding
	nonce := make([]byte, mlNonceSize)
	if _, err := rand.Read(nonce); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	b = append(b, nonce...)
	return aead.Seal(b, nonce, plain, hdr)
}

// readUpTo reads exactly n bytes, growing its buffer as they arrive, so
// that an announced length costs memory only once it is sent.
func readUpTo(r io.Reader, n int) ([]byte, error) {
	const chunk = 64 << 10
	buf := make([]byte, 0, min(n, chunk))
	for len(buf) < n {
		if len(buf) == cap(buf) {
			next := make([]byte, len(buf), min(n, 2*cap(buf)))
			copy(next, buf)
			buf = next
		}
		m, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+m]
		if err != nil && len(buf) < n {
			return buf, err
		}
	}
	return buf, nil
}

// replayConn reads the verified message, then EOF: memberlist reads one
// message from an incoming stream and only writes its answer after.
type replayConn struct {
	net.Conn
	buf []byte
}

func (c *replayConn) Read(p []byte) (int, error) {
	if len(c.buf) == 0 {
		return 0, io.EOF
	}
	n := copy(p, c.buf)
	c.buf = c.buf[n:]
	if len(c.buf) == 0 {
		c.buf = nil
	}
	return n, nil
}

// limitConn lets memberlist read at most left bytes of a plaintext stream
// (pending first) and calls onClose once.
type limitConn struct {
	net.Conn
	pending []byte
	left    int64
	over    bool
	once    sync.Once
	onClose func()
}

func (c *limitConn) Read(p []byte) (int, error) {
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	if c.left <= 0 {
		c.over = true
		return 0, fmt.Errorf("stream longer than the limit")
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.Conn.Read(p)
	c.left -= int64(n)
	return n, err
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		if c.onClose != nil {
			c.onClose()
		}
	})
	return err
}

// sourceAddr is the IP of a packet's or stream's source (invalid if unknown).
func sourceAddr(a net.Addr) netip.Addr {
	switch a := a.(type) {
	case *net.UDPAddr:
		ip, _ := netip.AddrFromSlice(a.IP)
		return ip.Unmap()
	case *net.TCPAddr:
		ip, _ := netip.AddrFromSlice(a.IP)
		return ip.Unmap()
	case nil:
		return netip.Addr{}
	}
	if ap, err := netip.ParseAddrPort(a.String()); err == nil {
		return ap.Addr().Unmap()
	}
	return netip.Addr{}
}

func addrPortString(a net.Addr) string {
	if a == nil {
		return "<unknown address>"
	}
	if ap, err := netip.ParseAddrPort(a.String()); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()
	}
	return a.String()
}
