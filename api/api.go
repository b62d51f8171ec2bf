// Package api is the local API between a weft router and the programs on its
// node that change state: the CNI plugin, `weft rmpeer` and `weft reset`. It is HTTP
// over a unix socket (mode 0600), so only root on the node can use it.
//
// This file holds the wire types and the validation both sides share; client.go
// is the client the plugin uses.
package api

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// Paths of the local API. All bodies are JSON.
const (
	PathIP     = "/v1/ip"     // POST: allocate (idempotent); GET: look up; DELETE: release
	PathGC     = "/v1/gc"     // POST: release everything not listed
	PathReady  = "/v1/ready"  // GET: 200 when the peer can attach pods, 503 with a reason otherwise
	PathRmpeer = "/v1/rmpeer" // POST: take over the ranges of a peer that is gone for good
	PathReset  = "/v1/reset"  // POST: hand this peer's ranges to a live peer, tear the node's network down, exit
)

// QueryAddress is the optional query parameter of a release (DELETE
// PathIP): the address the attachment had, from the plugin's prevResult.
// When the router holds nothing for the attachment but holds that address
// as re-claimed from its bridge after its state was lost, it frees it.
const QueryAddress = "address"

// ResetRequest asks the router to leave the cluster (weft reset).
type ResetRequest struct {
	// Force leaves even while pods on the node hold addresses; they may
	// then be handed out again elsewhere.
	Force bool `json:"force,omitempty"`
}

// ResetResponse says to which peer the ranges went. The router then
// removes its bridge, nftables table, CNI config and state, and exits.
type ResetResponse struct {
	Heir         string `json:"heir,omitempty"` // empty when no other peer shared the ring
	HeirNickname string `json:"heirNickname,omitempty"`
	Addresses    uint64 `json:"addresses"` // handed to Heir
	Dropped      int    `json:"dropped"`   // allocations dropped (pods, with force, and the gateway)
	Message      string `json:"message"`
}

// RmpeerRequest names the peer to remove, by name or nickname.
type RmpeerRequest struct {
	Peer string `json:"peer"`
}

// RmpeerResponse says what the router does about it.
type RmpeerResponse struct {
	Peer    string `json:"peer"`
	Message string `json:"message"`
}

// Limits on identifiers, as the CNI spec and container runtimes use them.
const (
	MaxContainerIDLen = 256 // runtimes use 64 hex characters; leave room for others
	MaxIfNameLen      = 15  // IFNAMSIZ - 1
)

// Attachment names one network attachment of one container: the key of an
// allocation. The same attachment always gets the same address.
type Attachment struct {
	ContainerID string `json:"containerID"`
	IfName      string `json:"ifName"`
}

func (a Attachment) String() string { return a.ContainerID + "/" + a.IfName }

// Validate says what is wrong with an attachment, in words an operator can act on.
func (a Attachment) Validate() error {
	if err := ValidateContainerID(a.ContainerID); err != nil {
		return err
	}
	return ValidateIfName(a.IfName)
}

// ValidateContainerID checks a container id as the CNI spec defines it:
// non-empty, at most MaxContainerIDLen, alphanumerics plus '_', '.' and '-'
// after an alphanumeric first character.
func ValidateContainerID(id string) error {
	if id == "" {
		return errors.New("container id is empty: the runtime must set CNI_CONTAINERID")
	}
	if len(id) > MaxContainerIDLen {
		return fmt.Errorf("container id is %d characters long, more than the %d allowed", len(id), MaxContainerIDLen)
	}
	for i, c := range id {
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if i == 0 && !alnum {
			return fmt.Errorf("container id %q must start with a letter or digit", id)
		}
		if !alnum && c != '_' && c != '.' && c != '-' {
			return fmt.Errorf("container id %q has the character %q; only letters, digits, '_', '.' and '-' are allowed", id, c)
		}
	}
	return nil
}

// ValidateIfName checks an interface name as Linux accepts it.
func ValidateIfName(name string) error {
	switch {
	case name == "":
		return errors.New("interface name is empty: the runtime must set CNI_IFNAME")
	case len(name) > MaxIfNameLen:
		return fmt.Errorf("interface name %q is longer than %d characters", name, MaxIfNameLen)
	case name == "." || name == "..":
		return fmt.Errorf("interface name %q is not allowed", name)
	case strings.ContainsAny(name, "/: \t\n\v\f\r\x00"):
		// What Linux refuses (dev_valid_name); a NUL cannot even be passed.
		return fmt.Errorf("interface name %q contains '/', ':', white space or a NUL byte", name)
	}
	return nil
}

// AllocateRequest asks for the address of an attachment. Netns and the pod
// fields are informational (logs, status); the key is the attachment.
type AllocateRequest struct {
	Attachment
	Netns        string `json:"netns,omitempty"`
	PodNamespace string `json:"podNamespace,omitempty"`
	PodName      string `json:"podName,omitempty"`
}

// Allocation is the answer to an allocation or a look-up: everything the plugin
// needs to wire the pod, so that its config names only the socket.
type Allocation struct {
	Attachment
	// Address is the pod's address with the prefix length of the pod network,
	// e.g. "10.32.0.5/12" in JSON. The one address type of the ADD path,
	// from the allocator to the plugin's CNI result (netip: text in JSON,
	// net.IPNet only in the CNI result and netlink).
	Address netip.Prefix `json:"address"`
	// Gateway is the bridge's address, the pod's default gateway.
	Gateway netip.Addr `json:"gateway"`
	// Bridge is the name of the bridge the host end of the veth joins.
	Bridge string `json:"bridge"`
	// MTU is the pod interface MTU.
	MTU int `json:"mtu"`
	// New is false when the attachment already held this address (a repeated ADD).
	New bool `json:"new"`
}

// ReleaseResponse says whether a release freed an address; releasing an
// attachment that holds none succeeds with Released false.
type ReleaseResponse struct {
	Released bool       `json:"released"`
	Address  netip.Addr `json:"address,omitzero"`
}

// GCRequest lists the attachments that are still valid; every other
// allocation of this node is released.
type GCRequest struct {
	Valid []Attachment `json:"valid"`
}

// GCResponse lists what GC released.
type GCResponse struct {
	Released []Allocation `json:"released"`
}

// Readiness is the body of PathReady.
type Readiness struct {
	Ready  bool   `json:"ready"`
	Reason string `json:"reason,omitempty"`
}

// Error codes of ErrorBody.
const (
	CodeInvalid   = "invalid"   // the request was wrong; retrying will not help
	CodeNotReady  = "not-ready" // the peer cannot serve yet; try again later
	CodeExhausted = "exhausted" // no free address in the space this peer owns or can get
	CodeNotFound  = "not-found" // no allocation for that attachment
	CodeConflict  = "conflict"  // refused in the router's present state (e.g. reset with pods); fix that and retry
	CodeInternal  = "internal"
)

// ErrorBody is the JSON body of every non-2xx answer.
type ErrorBody struct {
	Code    string `json:"code"`
	Message string `json:"error"`
}

// Error is what the client returns for a non-2xx answer.
type Error struct {
	Status int
	ErrorBody
}

func (e *Error) Error() string { return e.Message }

// IsCode reports whether err is an *Error with the given code.
func IsCode(err error, code string) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == code
}
