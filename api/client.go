package api

import (
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

// Client talks to one router's local API over its unix socket.
type Client struct {
	socket string
	hc     *http.Client
}

// NewClient returns a client for the router listening on socket.
func NewClient(socket string) *Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		DisableKeepAlives: true,
	}
	return &Client{socket: socket, hc: &http.Client{Transport: tr, Timeout: 30 * time.Second}}
}

// Socket is the path this client dials.
func (c *Client) Socket() string { return c.socket }

// ErrUnreachable wraps every failure to reach the router at all.
var ErrUnreachable = errors.New("weft router unreachable")

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
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("%w at %s: %v (is the weft router running on this node?)", ErrUnreachable, c.socket, err)
	}
	defer resp.Body.Close()
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
