package tun

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"github.com/songgao/water"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// DefaultBatchSize is how many packets a queue moves per wake-up.
const DefaultBatchSize = 128

// MaxQueues bounds the queues Open makes (the kernel allows 256 per device).
const MaxQueues = 16

// Open creates the TUN interface name in the calling thread's network
// namespace with the given number of queues (IFF_MULTI_QUEUE when more
// than one), sets its MTU and brings it up. It asks the kernel for TCP
// segmentation offload (IFF_VNET_HDR, TUNSETOFFLOAD): the queues then cut
// and join super-packets themselves (offload.go); a kernel that refuses
// gets a plain device through songgao/water (OpenPlain). The caller must
// keep the thread in the namespace for the call (ns.Do); the device's file
// descriptors stay in it afterwards. Closing the device removes the
// interface.
func Open(name string, mtu, queues int) (Device, error) {
	if err := checkArgs(name, mtu, queues); err != nil {
		return nil, err
	}
	qs, err := openOffload(name, queues)
	if errors.Is(err, errNoOffload) {
		return OpenPlain(name, mtu, queues)
	}
	if err != nil {
		return nil, err
	}
	d := &device{name: name, mtu: mtu, offload: true}
	for _, q := range qs {
		d.queues = append(d.queues, q)
		d.files = append(d.files, q.f)
	}
	return d.setUp()
}

func checkArgs(name string, mtu, queues int) error {
	if name == "" || len(name) >= unix.IFNAMSIZ {
		return fmt.Errorf("tun device name %q: give 1 to %d characters", name, unix.IFNAMSIZ-1)
	}
	if queues < 1 || queues > MaxQueues {
		return fmt.Errorf("tun device %s: %d queues: give 1 to %d", name, queues, MaxQueues)
	}
	if mtu < 68 || mtu > 65535 {
		return fmt.Errorf("tun device %s: MTU %d out of range 68..65535", name, mtu)
	}
	return nil
}

// OpenPlain is Open without offloads: a device opened through
// songgao/water, one packet per read(2) and write(2).
func OpenPlain(name string, mtu, queues int) (Device, error) {
	if err := checkArgs(name, mtu, queues); err != nil {
		return nil, err
	}
	d := &device{name: name, mtu: mtu}
	for i := range queues {
		ifce, err := water.New(water.Config{
			DeviceType:             water.TUN,
			PlatformSpecificParams: water.PlatformSpecificParams{Name: name, MultiQueue: queues > 1},
		})
		if err != nil {
			d.Close()
			return nil, openError(name, i, err)
		}
		f, ok := ifce.ReadWriteCloser.(*os.File)
		if !ok {
			ifce.Close()
			d.Close()
			return nil, fmt.Errorf("tun device %s: water returned %T, want *os.File", name, ifce.ReadWriteCloser)
		}
		d.files = append(d.files, f)
		rc, err := f.SyscallConn()
		if err != nil {
			d.Close()
			return nil, fmt.Errorf("tun device %s: %w", name, err)
		}
		q := &queue{rc: rc}
		q.readF = q.readBatch
		q.writeF = q.writeBatch
		d.queues = append(d.queues, q)
	}
	return d.setUp()
}

// setUp sets the MTU and brings the link up.
func (d *device) setUp() (Device, error) {
	link, err := netlink.LinkByName(d.name)
	if err == nil {
		err = netlink.LinkSetMTU(link, d.mtu)
	}
	if err == nil {
		err = netlink.LinkSetUp(link)
	}
	if err != nil {
		d.Close()
		return nil, fmt.Errorf("tun device %s: setting MTU %d and up: %w", d.name, d.mtu, err)
	}
	return d, nil
}

type device struct {
	name    string
	mtu     int
	offload bool
	queues  []Queue
	files   []*os.File
	once    sync.Once
	err     error
}

func (d *device) Name() string   { return d.name }
func (d *device) MTU() int       { return d.mtu }
func (d *device) BatchSize() int { return DefaultBatchSize }
func (d *device) Queues() []Queue {
	return append([]Queue(nil), d.queues...)
}

// Offload reports whether the device cuts and joins TCP super-packets.
func (d *device) Offload() bool { return d.offload }

func (d *device) Close() error {
	d.once.Do(func() {
		for _, f := range d.files {
			if err := f.Close(); err != nil && d.err == nil {
				d.err = fmt.Errorf("closing tun device %s: %w", d.name, err)
			}
		}
	})
	return d.err
}

// queue is one file descriptor of the device. A read loops read(2) until
// the batch is full or the queue is empty, inside one wake-up of the Go
// poller; a write loops write(2) likewise. The closures are bound once so
// that a call allocates nothing.
type queue struct {
	rc syscall.RawConn

	rmu     sync.Mutex // guards the read state below
	rbufs   [][]byte
	rsizes  []int
	roff, n int
	rerr    error
	readF   func(fd uintptr) bool

	batchWriter
}

// batchWriter is the write side shared by both kinds of queue: one batch at
// a time is handed to writeF through the raw conn, which records how far it
// got and what failed.
type batchWriter struct {
	wmu    sync.Mutex // guards the write state below
	wbufs  [][]byte
	woff   int
	wn     int
	wfail  int
	werr   error
	writeF func(fd uintptr) bool
}

// flush writes bufs (packets starting at offset) through rc with writeF.
func (w *batchWriter) flush(rc syscall.RawConn, bufs [][]byte, offset int) (int, error) {
	w.wmu.Lock()
	defer w.wmu.Unlock()
	w.wbufs, w.woff, w.wn, w.wfail, w.werr = bufs, offset, 0, 0, nil
	err := rc.Write(w.writeF)
	n, fail, werr := w.wn, w.wfail, w.werr
	w.wbufs = nil
	if err != nil {
		return n, closedOr(err)
	}
	if fail > 0 {
		return n, &WriteError{Failed: fail, Err: werr}
	}
	return n, nil
}

func (q *queue) Read(bufs [][]byte, sizes []int, offset int) (int, error) {
	q.rmu.Lock()
	defer q.rmu.Unlock()
	q.rbufs, q.rsizes, q.roff, q.n, q.rerr = bufs, sizes, offset, 0, nil
	err := q.rc.Read(q.readF)
	n, rerr := q.n, q.rerr
	q.rbufs, q.rsizes = nil, nil
	if n > 0 {
		return n, nil
	}
	if err != nil {
		return 0, closedOr(err)
	}
	return 0, rerr
}

func (q *queue) readBatch(fd uintptr) bool {
	for q.n < len(q.rbufs) && q.n < len(q.rsizes) {
		n, err := unix.Read(int(fd), q.rbufs[q.n][q.roff:])
		switch {
		case err == unix.EAGAIN:
			return q.n > 0 // wait for the poller unless something was read
		case err == unix.EINTR:
			continue
		case err != nil:
			q.rerr = closedOr(fmt.Errorf("tun read: %w", err))
			return true
		}
		q.rsizes[q.n] = n
		q.n++
	}
	return true
}

func (q *queue) Write(bufs [][]byte, offset int) (int, error) {
	return q.flush(q.rc, bufs, offset)
}

func (q *queue) writeBatch(fd uintptr) bool {
	for len(q.wbufs) > 0 {
		_, err := unix.Write(int(fd), q.wbufs[0][q.woff:])
		switch {
		case err == unix.EAGAIN:
			return false
		case err == unix.EINTR:
			continue
		case err != nil:
			if q.werr == nil {
				q.werr = err
			}
			q.wfail++
		default:
			q.wn++
		}
		q.wbufs = q.wbufs[1:]
	}
	return true
}

// closedOr maps the poller's "file already closed" to ErrClosed.
func closedOr(err error) error {
	if errors.Is(err, os.ErrClosed) || errors.Is(err, unix.EBADFD) {
		return ErrClosed
	}
	return err
}
