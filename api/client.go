package api

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"time"
)

// DefaultSocket is where a router serves the local API unless told otherwise.
const DefaultSocket = "/run/weft/weft.sock"

// maxBody bounds what either side reads from the other.
const maxBody = 1 << 20

// requestTimeout bounds one request, its answer included.
const requestTimeout = 30 * time.Second

// Client talks to one router's local API over its unix socket: one
// connection per request (the plugin is a new process per call), the
// request written and its answer read with net/http's own encoding
// (Request.Write, ReadResponse), without a Transport, whose pool,
// goroutines and buffers per connection a single request never uses.
type Client struct {
	socket string
}

// NewClient returns a client for the router listening on socket.
func NewClient(socket string) *Client {
	return &Client{socket: socket}
}

// Socket is the path this client dials.
func (c *Client) Socket() string { return c.socket }

// ErrUnreachable wraps every failure to reach the router at all.
var ErrUnreachable = errors.New("weft router unreachable")

// roundTrip sends req on a new connection and reads the answer's head;
// the caller reads the body and closes the connection. It is bounded by
// ctx and by requestTimeout.
func (c *Client) roundTrip(ctx context.Context, req *http.Request) (*http.Response, net.Conn, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	conn, err := d.DialContext(dctx, "unix", c.socket)
	if err != nil {
		return nil, nil, err
	}
	deadline, _ := dctx.Deadline()
	conn.SetDeadline(deadline)
	// A cancelled ctx ends a request that waits: the connection's
	// deadline moves to the past.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	fail := func(err error) (*http.Response, net.Conn, error) {
		stop()
		conn.Close()
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return nil, nil, err
	}
	var buf bytes.Buffer // the whole request, written at once
	// Room for the head and the body, which Request.Write copies with
	// room for 512 bytes more (bytes.MinRead): one allocation.
	buf.Grow(1024 + int(req.ContentLength))
	if err := req.Write(&buf); err != nil {
		return fail(err)
	}
	if _, err := conn.Write(buf.Bytes()); err != nil {
		return fail(err)
	}
	resp, err := http.ReadResponse(bufio.NewReaderSize(conn, 1024), req)
	if err != nil {
		return fail(err)
	}
	return resp, stopConn{conn, stop}, nil
}

// stopConn is a connection whose Close also ends its context watch.
type stopConn struct {
	net.Conn
	stop func() bool
}

func (s stopConn) Close() error { s.stop(); return s.Conn.Close() }

func (c *Client) do(ctx context.Context, method, path string, q url.Values, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	u := "http://weft" + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Close = true // Connection: close
	resp, conn, err := c.roundTrip(ctx, req)
	if err != nil {
		return fmt.Errorf("%w at %s: %v (is the weft router running on this node?)", ErrUnreachable, c.socket, err)
	}
	defer conn.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return fmt.Errorf("reading answer of weft router at %s: %w", c.socket, err)
	}
	if resp.StatusCode/100 != 2 {
		e := &Error{Status: resp.StatusCode}
		if json.Unmarshal(data, &e.ErrorBody) != nil || e.Message == "" {
			e.Code, e.Message = CodeInternal, fmt.Sprintf("weft router answered %s: %.200s", resp.Status, data)
		}
		return e
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("decoding answer of weft router at %s: %w", c.socket, err)
	}
	return nil
}

// Allocate returns the address of the attachment, allocating one if it has none.
func (c *Client) Allocate(ctx context.Context, req AllocateRequest) (*Allocation, error) {
	var a Allocation
	if err := c.do(ctx, http.MethodPost, PathIP, nil, req, &a); err != nil {
		return nil, err
	}
	return &a, nil
}

// Lookup returns the allocation of the attachment, or an *Error with CodeNotFound.
func (c *Client) Lookup(ctx context.Context, att Attachment) (*Allocation, error) {
	var a Allocation
	if err := c.do(ctx, http.MethodGet, PathIP, attQuery(att), nil, &a); err != nil {
		return nil, err
	}
	return &a, nil
}

// Release frees the attachment's address; releasing twice succeeds.
func (c *Client) Release(ctx context.Context, att Attachment) (*ReleaseResponse, error) {
	var r ReleaseResponse
	if err := c.do(ctx, http.MethodDelete, PathIP, attQuery(att), nil, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// GC releases every allocation of this node that is not in valid.
func (c *Client) GC(ctx context.Context, valid []Attachment) (*GCResponse, error) {
	var r GCResponse
	if valid == nil {
		valid = []Attachment{}
	}
	if err := c.do(ctx, http.MethodPost, PathGC, nil, GCRequest{Valid: valid}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// Ready returns nil when the router can attach pods, and otherwise an error
// that says why (an *Error with CodeNotReady, or ErrUnreachable).
func (c *Client) Ready(ctx context.Context) error {
	var r Readiness
	return c.do(ctx, http.MethodGet, PathReady, nil, nil, &r)
}

// Rmpeer asks the router to take over the ranges of a peer that is gone.
func (c *Client) Rmpeer(ctx context.Context, peer string) (*RmpeerResponse, error) {
	var r RmpeerResponse
	if err := c.do(ctx, http.MethodPost, PathRmpeer, nil, RmpeerRequest{Peer: peer}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// ReleaseWithPrev is Release for a DEL that knows the address the
// attachment had (the plugin's prevResult): if the router holds nothing for
// the attachment but holds prev as re-claimed from its bridge (after its
// state was lost), it frees prev.
func (c *Client) ReleaseWithPrev(ctx context.Context, att Attachment, prev netip.Addr) (*ReleaseResponse, error) {
	var r ReleaseResponse
	q := attQuery(att)
	if prev.IsValid() {
		q.Set(QueryAddress, prev.String())
	}
	if err := c.do(ctx, http.MethodDelete, PathIP, q, nil, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// Reset asks the router to leave the cluster (weft reset): it hands its
// ranges to a live peer and waits until that peer has saved them, then
// tears the node's network down and exits. It answers before the
// teardown; the router's socket goes away when it is done.
func (c *Client) Reset(ctx context.Context, force bool) (*ResetResponse, error) {
	var r ResetResponse
	if err := c.do(ctx, http.MethodPost, PathReset, nil, ResetRequest{Force: force}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

func attQuery(a Attachment) url.Values {
	return url.Values{"containerID": {a.ContainerID}, "ifName": {a.IfName}}
}

// AttachmentFromQuery reads the attachment of a GET or DELETE request.
func AttachmentFromQuery(q url.Values) Attachment {
	return Attachment{ContainerID: q.Get("containerID"), IfName: q.Get("ifName")}
}
