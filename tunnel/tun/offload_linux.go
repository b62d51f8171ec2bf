package tun

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// errNoOffload says the kernel refused the offloads; Open then falls back
// to a plain device.
var errNoOffload = errors.New("TUN offloads not available")

// offloadBufSize holds the largest packet the kernel hands over: a 64 KiB
// super-packet behind its virtio_net_hdr.
const offloadBufSize = VirtioNetHdrLen + maxIPv4Len

// openOffload opens the device with IFF_VNET_HDR and turns on checksum
// and TCP/IPv4 segmentation offload (TUNSETOFFLOAD), one file per queue.
func openOffload(name string, queues int) ([]*offloadQueue, error) {
	flags := uint16(unix.IFF_TUN | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if queues > 1 {
		flags |= unix.IFF_MULTI_QUEUE
	}
	var qs []*offloadQueue
	closeAll := func() {
		for _, q := range qs {
			q.f.Close()
		}
	}
	for i := range queues {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("opening /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(name)
		if err == nil {
			ifr.SetUint16(flags)
			err = unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr)
		}
		if err != nil {
			unix.Close(fd)
			closeAll()
			return nil, openError(name, i, err)
		}
		if err := unix.IoctlSetInt(fd, unix.TUNSETOFFLOAD, unix.TUN_F_CSUM|unix.TUN_F_TSO4); err != nil {
			unix.Close(fd)
			closeAll()
			return nil, fmt.Errorf("%w: TUNSETOFFLOAD: %w", errNoOffload, err)
		}
		f := os.NewFile(uintptr(fd), "tun")
		rc, err := f.SyscallConn()
		if err != nil {
			f.Close()
			closeAll()
			return nil, err
		}
		q := &offloadQueue{f: f, rc: rc, rbuf: make([]byte, offloadBufSize), wbuf: make([]byte, offloadBufSize)}
		q.readF, q.writeF = q.readOnce, q.writeRuns
		qs = append(qs, q)
	}
	return qs, nil
}

func openError(name string, queue int, err error) error {
	switch {
	case errors.Is(err, unix.EBUSY):
		return fmt.Errorf("tun device %s is held by another process (is another weft router running in this network namespace?): %w", name, err)
	case errors.Is(err, unix.EINVAL) && queue == 0:
		return fmt.Errorf("opening tun device %s: %w; a link of that name that is not a TUN device of this kind may exist: remove it", name, err)
	}
	return fmt.Errorf("opening tun device %s (queue %d): %w", name, queue, err)
}

// offloadQueue is one queue of an offloading device. Read cuts the
// kernel's super-packets into packets; Write joins runs of TCP segments
// into super-packets. Each side has its own buffer and lock.
type offloadQueue struct {
	f  *os.File
	rc syscall.RawConn

	rmu   sync.Mutex // guards the read side
	rbuf  []byte     // one packet from the kernel, virtio_net_hdr first
	split splitter   // the super-packet in rbuf being cut, if any
	rwait bool       // readOnce waits for a packet
	rn    int
	rerr  error
	readF func(fd uintptr) bool

	batchWriter
	wbuf []byte // a coalesced super-packet; guarded by batchWriter.wmu
}

func (q *offloadQueue) Read(bufs [][]byte, sizes []int, offset int) (int, error) {
	q.rmu.Lock()
	defer q.rmu.Unlock()
	n := 0
	for n < len(bufs) && n < len(sizes) {
		if !q.split.done() {
			k, err := q.split.cut(bufs[n][offset:])
			if err != nil {
				continue // dropped: the rest of a malformed super-packet
			}
			sizes[n] = k
			n++
			continue
		}
		got, err := q.readOne(n == 0)
		if err != nil {
			if n > 0 {
				return n, nil
			}
			return 0, err
		}
		if got == 0 { // nothing more without waiting
			return n, nil
		}
		if got < VirtioNetHdrLen {
			continue
		}
		var h virtioNetHdr
		h.decode(q.rbuf)
		pkt := q.rbuf[VirtioNetHdrLen:got]
		if h.gsoType != vnetGSONone {
			if q.split.start(pkt, &h) != nil {
				continue // dropped: not a super-packet this device asked for
			}
			continue
		}
		if h.flags&vnetFlagNeedsCsum != 0 && finishChecksum(pkt, &h) != nil {
			continue
		}
		if len(pkt) > len(bufs[n])-offset {
			continue // larger than the MTU allows: cannot happen without GSO
		}
		sizes[n] = copy(bufs[n][offset:], pkt)
		n++
	}
	return n, nil
}

// readOne reads one packet into rbuf; with wait false it returns 0 rather
// than wait for one.
func (q *offloadQueue) readOne(wait bool) (int, error) {
	q.rwait, q.rn, q.rerr = wait, 0, nil
	if err := q.rc.Read(q.readF); err != nil {
		return 0, closedOr(err)
	}
	return q.rn, q.rerr
}

func (q *offloadQueue) readOnce(fd uintptr) bool {
	for {
		n, err := unix.Read(int(fd), q.rbuf)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return !q.rwait
		case err != nil:
			q.rerr = closedOr(fmt.Errorf("tun read: %w", err))
		default:
			q.rn = n
		}
		return true
	}
}

func (q *offloadQueue) Write(bufs [][]byte, offset int) (int, error) {
	if offset < VirtioNetHdrLen {
		return 0, fmt.Errorf("tun write: offset %d leaves no room for the %d-byte virtio_net_hdr", offset, VirtioNetHdrLen)
	}
	return q.flush(q.rc, bufs, offset)
}

// writeRuns writes the pending packets, each run of segments of one TCP
// flow as one super-packet.
func (q *offloadQueue) writeRuns(fd uintptr) bool {
	for len(q.wbufs) > 0 {
		run := runLength(q.wbufs, 0, q.woff)
		var b []byte
		if run == 1 {
			b = q.wbufs[0][q.woff-VirtioNetHdrLen:]
			clear(b[:VirtioNetHdrLen]) // no offload: a whole packet, checksums done
		} else {
			b = q.wbuf[:coalesce(q.wbuf, q.wbufs[:run], q.woff)]
		}
		_, err := unix.Write(int(fd), b)
		switch {
		case err == unix.EAGAIN:
			return false
		case err == unix.EINTR:
			continue
		case err != nil:
			if q.werr == nil {
				q.werr = err
			}
			q.wfail += run
		default:
			q.wn += run
		}
		q.wbufs = q.wbufs[run:]
	}
	return true
}
