package bridge

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/mdlayher/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// policyLogReadBuffer is the socket's receive buffer: room for some
// thousands of samples while the reader is busy (the chains' limit sends
// at most PolicyLogRate a second each).
const policyLogReadBuffer = 1 << 20

// PolicyLog reads the samples of packets that NetworkPolicy dropped, from
// nfnetlink_log group PolicyLogGroup of one network namespace (the one
// whose table ip weft-policy writes them). One reader per namespace: the
// kernel gives a group to one socket.
type PolicyLog struct {
	c *netlink.Conn
	// lost counts the samples the kernel could not queue to the socket
	// (its buffer full: ENOBUFS) and the messages that did not decode.
	lost   atomic.Uint64
	closed atomic.Bool
}

// OpenPolicyLog binds group PolicyLogGroup in the network namespace at
// nsPath ("" = the caller's own), asking for PolicyLogSnaplen bytes of
// each packet.
func OpenPolicyLog(nsPath string) (*PolicyLog, error) {
	cfg := &netlink.Config{}
	if nsPath != "" {
		fd, err := netns.GetFromPath(nsPath)
		if err != nil {
			return nil, fmt.Errorf("open network namespace %q: %w", nsPath, err)
		}
		defer fd.Close()
		cfg.NetNS = int(fd)
	}
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, cfg)
	if err != nil {
		return nil, fmt.Errorf("open a netfilter netlink socket for the policy samples: %w", err)
	}
	l := &PolicyLog{c: c}
	if err := l.bind(); err != nil {
		c.Close()
		return nil, err
	}
	if err := c.SetReadBuffer(policyLogReadBuffer); err != nil {
		c.Close()
		return nil, fmt.Errorf("set the policy samples' socket buffer: %w", err)
	}
	return l, nil
}

// config sends one NFULNL_MSG_CONFIG for the group with attribute typ.
func (l *PolicyLog) config(typ uint16, data []byte) error {
	ae := netlink.NewAttributeEncoder()
	ae.Bytes(typ, data)
	attrs, err := ae.Encode()
	if err != nil {
		return err
	}
	// nfgenmsg: family AF_UNSPEC, version 0, the group (big endian).
	msg := binary.BigEndian.AppendUint16([]byte{unix.AF_UNSPEC, 0}, PolicyLogGroup)
	_, err = l.c.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(nfnlSubsysULOG<<8 | nfulnlMsgConfig), Flags: netlink.Request | netlink.Acknowledge},
		Data:   append(msg, attrs...),
	})
	return err
}

func (l *PolicyLog) bind() error {
	if err := l.config(nfulaCfgCmd, []byte{nfulnlCfgCmdBind}); err != nil {
		if errors.Is(err, unix.EPERM) {
			// The kernel says EPERM both to a second socket binding a
			// group and to a process without CAP_NET_ADMIN.
			return fmt.Errorf("bind nflog group %d: %w: another process reads it (a second weft router in this network namespace?), or this one lacks CAP_NET_ADMIN", PolicyLogGroup, err)
		}
		return fmt.Errorf("bind nflog group %d (the kernel needs nfnetlink_log): %w", PolicyLogGroup, err)
	}
	// struct nfulnl_msg_config_mode: copy_range (big endian), copy_mode, pad.
	mode := binary.BigEndian.AppendUint32(nil, PolicyLogSnaplen)
	mode = append(mode, nfulnlCopyPacket, 0)
	if err := l.config(nfulaCfgMode, mode); err != nil {
		return fmt.Errorf("set the copy mode of nflog group %d: %w", PolicyLogGroup, err)
	}
	return nil
}

// ErrPolicyLogClosed is what Read returns after Close.
var ErrPolicyLogClosed = errors.New("policy log closed")

// Read waits for the next samples. A buffer overrun or a message that
// does not decode is counted in Lost, not returned; after Close it
// returns ErrPolicyLogClosed.
func (l *PolicyLog) Read() ([]BlockedPacket, error) {
	for {
		msgs, err := l.c.Receive()
		if l.closed.Load() {
			return nil, ErrPolicyLogClosed
		}
		if errors.Is(err, unix.ENOBUFS) {
			l.lost.Add(1)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read nflog group %d: %w", PolicyLogGroup, err)
		}
		var out []BlockedPacket
		for _, m := range msgs {
			if m.Header.Type != netlink.HeaderType(nfnlSubsysULOG<<8|nfulnlMsgPacket) {
				continue
			}
			b, err := parsePolicySample(m.Data)
			if err != nil {
				l.lost.Add(1)
				continue
			}
			out = append(out, b)
		}
		if len(out) > 0 {
			return out, nil
		}
	}
}

// Lost is the number of samples lost to overruns and decoding.
func (l *PolicyLog) Lost() uint64 { return l.lost.Load() }

// Close unbinds the group (closing the socket does) and ends a Read.
func (l *PolicyLog) Close() error {
	if l.closed.Swap(true) {
		return nil
	}
	return l.c.Close()
}
